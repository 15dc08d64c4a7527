"""The loss of one micro-batch, whatever the backend: the per-sample fields it reads, the reducers,
and the dispatch through :data:`slime.algorithms.functional.LOSS_FUNCTIONS` (the critic: ``value_loss``;
the actor: ``--loss-type``, ``custom_loss`` resolved from ``--custom-loss-function-path``).
"""

from __future__ import annotations

from typing import Callable

import torch

from slime.backends.training.backend import ModelOutput, ModelOutputs
from slime.algorithms import functional as algo
from slime.utils.misc import load_function

__all__ = ["LossDispatch", "micro_batch_fields"]

_FIELDS = ("loss_masks", "advantages", "returns", "values", "log_probs", "ref_log_probs", "rollout_log_probs",
           "teacher_log_probs", "opd_reverse_kl", "tokens")


def micro_batch_fields(data, micro_batch: list[int]) -> dict:
    """The docs/INTERFACES.md §2.10 ``batch`` dict of one micro-batch of a :class:`~slime.backends.training.batch.TrainBatch`:
    per-sample lists of its columns."""
    batch = {}
    for key in _FIELDS:
        column = getattr(data, key)
        if column is not None:
            batch[key] = [column[i] for i in micro_batch]
    batch["response_lengths"] = [int(data.response_lengths[i]) for i in micro_batch]
    batch["total_lengths"] = [int(data.tokens[i].numel()) for i in micro_batch]
    sums = data.rollout_mask_sums
    batch["rollout_mask_sums"] = [float(sums[i]) for i in micro_batch]
    return batch


class LossDispatch:
    """Resolves the loss for ``role`` once (hooks loaded from their dotted paths) and computes it per micro-batch."""

    def __init__(self, args, role: str):
        self.args, self.role = args, role
        self.loss_type = "value_loss" if role == "critic" else args.loss_type
        function = algo.lookup(algo.LOSS_FUNCTIONS, self.loss_type, "--loss-type")
        self.function = function if function is not None else load_function(args.custom_loss_function_path)
        path = args.custom_pg_loss_reducer_function_path
        self.pg_reducer_factory = load_function(path) if path else None
        self.tis_function = None
        if args.use_tis or args.get_mismatch_metrics:
            tis_path = args.custom_tis_function_path
            self.tis_function = load_function(tis_path) if tis_path else algo.vanilla_tis_function

    @property
    def output(self) -> ModelOutput:
        """What the training forward must produce for this loss."""
        if self.role == "critic":
            return ModelOutput("values")
        if self.loss_type == "custom_loss":
            return ModelOutput("logits")
        entropy_grad = self.args.entropy_coef != 0
        return ModelOutput("log_probs", entropy=self.loss_type == "policy_loss", entropy_grad=entropy_grad)

    def __call__(self, data, micro_batch: list[int], outputs: ModelOutputs) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) of one micro-batch; metrics are S-reduced sums (docs/INTERFACES.md §5.8) on the device."""
        args = self.args
        batch = micro_batch_fields(data, micro_batch)
        reducer = algo.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"],
                                                    batch["rollout_mask_sums"], args.calculate_per_token_loss)
        if self.loss_type == "value_loss":
            return self.function(args, batch, outputs.values, reducer)
        if self.loss_type == "custom_loss":
            batch["unconcat_tokens"] = batch.get("tokens")
            batch.update(outputs.extras)
            return self.function(args, batch, outputs.logits, reducer)
        if self.loss_type == "policy_loss":
            return self.function(args, batch, outputs.log_probs, outputs.entropy, reducer,
                                 pg_reducer_factory=self._pg_reducer_factory(batch), tis_function=self.tis_function)
        return self.function(args, batch, outputs.log_probs, reducer)

    def _pg_reducer_factory(self, batch: dict) -> Callable | None:
        """``--custom-pg-loss-reducer-function-path`` applied to the micro-batch and the masks it is
        given (the TIS-modified ones when TIS/RS rejects tokens, §2.12)."""
        if self.pg_reducer_factory is None:
            return None
        factory, args = self.pg_reducer_factory, self.args
        return lambda masks: factory(batch["total_lengths"], batch["response_lengths"], masks, args.calculate_per_token_loss)


def metrics_to_host(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float64 host scalars, with one device-to-host copy for all of a micro-batch's metrics."""
    if not metrics:
        return {}
    keys = list(metrics)
    values = torch.stack([metrics[k].detach().double().reshape(()) for k in keys]).cpu()
    return dict(zip(keys, values))

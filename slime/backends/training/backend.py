"""The narrow interface a training backend implements, and the records that cross it.

:class:`~slime.backends.training.worker.TrainWorker` owns the rollout-step flow (π_old and
reference passes, KL, advantages, the loss dispatch, the step loop, metrics, weight buckets,
FLOPs); a backend owns the model and its parallelism. The backend's side:

* ``init()`` builds the trained model (and the reference / old-actor copies the flags ask for),
  the optimizer and its schedule, loads weights or resumes; it returns the rollout id to start
  from, and afterwards ``layout`` says how the ranks share samples;
* ``forward_only(which, batch, output)``: per-sample results of a pass without gradients over
  the micro-batches of ``batch`` (a :class:`~slime.backends.training.batch.TrainBatch`) (``which``: ``"model"``, ``"ref"`` or ``"old_actor"``);
* ``forward_backward(batch, micro_batches, output, loss_fn)``: gradients of Σ loss_fn over the
  micro-batches of one optimizer step; ``loss_fn`` returns ``(loss, host metrics)`` and the
  backend returns the host metrics of every micro-batch whose loss it computed;
* ``optimizer_step()``, ``zero_grad()``, ``reset_optimizer_state()``;
* ``named_hf_weights(dtype)``: HF-named full tensors (collective; the core buckets them);
* ``save(rollout_id)``, ``save_hf(path)``; ``offload()``, ``onload()``;
* ``copy_weights(source, target)`` between the model kinds above; ``hf_config()`` for FLOPs;
* ``model``, ``optimizer``, ``scheduler`` for the before-train-step hook.

Backends are registered by name in :data:`BACKENDS` (dotted paths, imported on use), so this
package imports no backend.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["BACKENDS", "DataLayout", "ModelOutput", "ModelOutputs", "TrainBackend", "apply_freeze_lists", "backend_class"]

#: ``--train-backend`` name -> the class implementing :class:`TrainBackend`.
BACKENDS = {
    "fsdp": "slime.backends.fsdp_utils.backend.FSDPBackend",
    "megatron": "slime.backends.megatron_utils.backend.MegatronBackend",
}


def backend_class(name: str) -> type["TrainBackend"]:
    from slime.utils.misc import load_function

    if name not in BACKENDS:
        raise ValueError(f"unknown --train-backend {name!r}; valid: {', '.join(sorted(BACKENDS))}")
    return load_function(BACKENDS[name])


@dataclass(frozen=True)
class DataLayout:
    """How the training ranks share one rollout step's samples, declared by the backend at start.

    dp_rank / dp_size: this rank's data-parallel shard and the number of shards; the rollout manager
    cuts each step into ``dp_size`` shards and every rank of a data-parallel replica gets the same one.
    replica_size: ranks that hold the same samples (TP × PP × CP under Megatron; 1 under FSDP).
    loss_copies: ranks of one replica that report the same loss sums (Megatron: the TP × CP ranks of
    the last pipeline stage; 1 under FSDP) — metric sums over all ranks are divided by it.
    """

    dp_rank: int
    dp_size: int
    replica_size: int = 1
    loss_copies: int = 1


@dataclass(frozen=True)
class ModelOutput:
    """What a pass computes per response token.

    kind: ``"log_probs"`` (log π of the response tokens at ``--rollout-temperature``, optionally the
    entropy), ``"values"`` (the critic's value head) or ``"logits"`` (every position's logits, for a
    custom loss). ``entropy``: also return the entropy; ``entropy_grad``: let gradients flow through it.
    """

    kind: str
    entropy: bool = False
    entropy_grad: bool = False

    def __post_init__(self):
        if self.kind not in ("log_probs", "values", "logits"):
            raise ValueError(f"ModelOutput.kind must be log_probs, values or logits, got {self.kind!r}")


@dataclass
class ModelOutputs:
    """One micro-batch's outputs, on the device, in sample order of the micro-batch.

    log_probs / entropy / values: flat ``[K]`` float32 over the response tokens (K = Σ response
    lengths), ``None`` when not computed. logits: ``[1, T, V]`` float32 (custom loss only).
    extras: backend-specific entries a custom loss may read (e.g. the packed ``tokens``).
    """

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)


#: ``loss_fn(micro_batch, outputs) -> (loss, host metrics)``: micro_batch = local sample positions.
LossFn = Callable[[list[int], ModelOutputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainBackend(abc.ABC):
    """One rank's model, optimizer and parallelism; see the module docstring for the contract."""

    layout: DataLayout
    model: Any
    optimizer: Any
    scheduler: Any
    offloaded: bool = False

    def __init__(self, args, role: str):
        if role not in ("actor", "critic"):
            raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")
        self.args, self.role = args, role
        self.global_step = 0

    @abc.abstractmethod
    def init(self) -> int | None: ...

    @abc.abstractmethod
    def has_model(self, which: str) -> bool: ...

    @abc.abstractmethod
    def forward_only(self, which: str, batch, output: ModelOutput) -> tuple[list, list | None]:
        """(per-sample values, per-sample entropy or None) for every sample of ``batch``, on the host."""

    @abc.abstractmethod
    def forward_backward(self, batch, micro_batches: list[list[int]], output: ModelOutput, loss_fn: LossFn
                         ) -> list[dict[str, torch.Tensor]]: ...

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def optimizer_step(self) -> tuple[float, list[float]]:
        """Clip, step the optimizer and the lr schedule; returns (grad norm, lr per param group)."""

    @abc.abstractmethod
    def reset_optimizer_state(self) -> None: ...

    @abc.abstractmethod
    def named_hf_weights(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]: ...

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None: ...

    def wait_for_save(self) -> None:
        """Return once the last ``save`` is on disk (``--async-save``); a backend that saves
        synchronously has nothing to wait for."""

    @abc.abstractmethod
    def save_hf(self, path: str) -> None: ...

    @abc.abstractmethod
    def offload(self) -> None: ...

    @abc.abstractmethod
    def onload(self) -> None: ...

    def begin_offload(self) -> None:
        """Start moving to host memory what the weight push does not read (the optimizer state), so that it
        overlaps the push; :meth:`offload` finishes. A backend without it moves everything in ``offload``."""

    @abc.abstractmethod
    def copy_weights(self, source: str, target: str) -> None: ...

    @abc.abstractmethod
    def hf_config(self) -> dict: ...

    def finish_rollout_step(self) -> None:
        """Drop per-rollout-step state (e.g. recorded MoE routing); nothing by default."""

    def weight_dtype(self) -> torch.dtype | None:
        """The dtype weights are exported in when the caller does not choose (None: as stored)."""
        return None


def apply_freeze_lists(model: torch.nn.Module, args) -> None:
    """``--only-train-params-name-list`` / ``--freeze-params-name-list``: regexes on the model's
    parameter names (HF names under FSDP, Megatron names under Megatron)."""
    import re

    only = args.only_train_params_name_list
    freeze = args.freeze_params_name_list
    if not only and not freeze:
        return
    for name, param in model.named_parameters():
        if only:
            param.requires_grad_(any(re.search(p, name) for p in only))
        else:
            param.requires_grad_(not any(re.search(p, name) for p in freeze))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("--only-train-params-name-list / --freeze-params-name-list left no trainable parameter")

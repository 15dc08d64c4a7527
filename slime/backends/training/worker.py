"""The training worker: one per rank, the rollout-step flow written once over a :class:`TrainBackend`.

Used in a process where ``torch.distributed`` is initialised (gloo on CPU, NCCL on GPU); every
method is collective (all ranks call it) and takes/returns picklable values.

Rollout step, actor (``train``):
  1. forward-only passes over this rank's micro-batches: π_old log-probs (unless
     ``--use-rollout-logprobs``, or skipped: :meth:`TrainWorker.skips_old_log_prob_pass`), reference
     log-probs (``--use-kl-loss`` / ``--kl-coef``), entropy (``--use-rollout-entropy``); skipped for
     columns the batch already has;
  2. shaping KL, advantages and returns (``--custom-advantage-function-path`` or the estimator),
     OPD, whitening over the data-parallel ranks;
  3. ``--rollout-data-postprocess-path`` hook ``(args, rollout_id, rollout_data)``;
  4. one optimizer step per ``global_batch_sizes`` entry: the before-train-step hook, forward and
     backward of each micro-batch with the loss scaled so that the step objective is exactly docs/INTERFACES.md §5.8
     (per-rollout: Σ S / B; per-token: Σ S / tokens) whatever the micro-batch split and layout,
     then the backend's optimizer step.

PPO, the critic API — a second worker with ``role="critic"``: ``values = critic.compute_values(data)``
(V_old per sample over the response); with ``--kl-coef`` ≠ 0 also ``actor.compute_log_probs(data)``
so both sides see the same KL; then ``critic.train(rollout_id, data)`` (GAE returns, fits V) and
``actor.train(rollout_id, data)`` with the same fields. For the first ``--num-critic-only-steps``
rollout steps the caller skips ``actor.train``.

Every rank of a data-parallel replica (``layout.replica_size`` ranks) receives the same shard, a
:class:`~slime.backends.training.batch.TrainBatch`; hooks documented to take the ``rollout_data``
dict get its dict view.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist

from slime.backends.training import metrics as metrics_lib
from slime.backends.training.backend import DataLayout, ModelOutput, TrainBackend, backend_class
from slime.backends.training.batch import TrainBatch
from slime.backends.training.flops import FlopShape, training_flops
from slime.backends.training.loss import LossDispatch, metrics_to_host
from slime.backends.training.weights import bucket_weights
from slime.observability.profiling import TrainProfiler
from slime.algorithms import functional as algo
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

__all__ = ["TrainWorker"]


class TrainWorker:
    """One rank of the actor (``role="actor"``) or critic (``role="critic"``) trainer."""

    def __init__(self, args, role: str = "actor", backend: TrainBackend | None = None):
        if not dist.is_initialized():
            raise RuntimeError("TrainWorker needs torch.distributed initialised (gloo on CPU, NCCL on GPU)")
        self.backend = backend if backend is not None else backend_class(args.train_backend)(args, role)
        self.args, self.role = self.backend.args, role  # a backend may apply per-role overrides to args
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.loss = LossDispatch(self.args, role)
        self.forward_only_passes = 0  # forward-only passes over a rollout's data (π_old, reference, values)
        self.step_metrics: list[dict[str, float]] = []
        self._flop_shape: FlopShape | None = None
        self.profiler = TrainProfiler(self.args, self.rank, role)  # --use-pytorch-profiler, --record-memory-history

    @property
    def layout(self) -> DataLayout:
        return self.backend.layout

    def init(self) -> int | None:
        """Build the backend's models; returns the rollout id to start from (checkpoint + 1) or None."""
        if self.args.deterministic_mode:
            # cuBLAS needs a fixed workspace for deterministic matmuls; set before the first CUDA GEMM
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        return self.backend.init()

    # ------------------------------------------------------------------ forward-only passes

    def _forward_only(self, which: str, batch: TrainBatch, output: ModelOutput):
        self.forward_only_passes += 1
        return self.backend.forward_only(which, batch, output)

    def skips_old_log_prob_pass(self, batch: TrainBatch) -> bool:
        """docs/INTERFACES.md §5: with exactly one optimizer step in this rollout step and nothing else needing π_old
        from a separate pass, the loss uses log π_old = stopgrad(log π_θ) (ratio ≡ 1, the same
        loss and gradients) and the forward-only π_old pass is skipped. Custom advantage and
        rollout-data hooks may read ``log_probs``, and the train debug dump (docs/INTERFACES.md §7.6) records them, so
        they keep the pass."""
        args = self.args
        return (
            self.role == "actor"
            and args.loss_type == "policy_loss"
            and batch.schedule.num_steps == 1
            and args.kl_coef == 0
            and not args.use_rollout_logprobs
            and not args.get_mismatch_metrics
            and not args.use_rollout_entropy
            and not args.log_correct_samples
            and args.advantage_estimator not in ("ppo", "gspo")
            and not args.keep_old_actor
            and not args.use_opd
            and not (args.use_routing_replay and not args.use_rollout_routing_replay)
            and not args.custom_advantage_function_path
            and not args.rollout_data_postprocess_path
            and not args.save_debug_train_data
        )

    def compute_log_probs(self, batch: TrainBatch, skip_old: bool = False) -> dict[str, list[torch.Tensor]]:
        """π_old log-probs (not with ``skip_old``), reference log-probs and the shaping KL (docs/INTERFACES.md §5.2)
        for this shard's samples, as columns (``log_probs``, ``ref_log_probs``, ``entropy``, ``kl``)."""
        with self.profiler.phase("train_log_probs"):
            return self._compute_log_probs(batch, skip_old)

    def _compute_log_probs(self, batch: TrainBatch, skip_old: bool) -> dict[str, list[torch.Tensor]]:
        args = self.args
        result: dict[str, list[torch.Tensor]] = {}
        if batch.log_probs is None and not args.use_rollout_logprobs and not skip_old:
            # --log-correct-samples reports the entropy of correct samples: the π_old pass computes it
            with_entropy = args.use_rollout_entropy or args.log_correct_samples
            # --keep-old-actor: π_old = the actor before the last update
            which = "old_actor" if self.backend.has_model("old_actor") else "model"
            result["log_probs"], entropy = self._forward_only(which, batch, ModelOutput("log_probs", entropy=with_entropy))
            if entropy is not None:
                result["entropy"] = entropy
        if self.backend.has_model("ref") and batch.ref_log_probs is None:
            result["ref_log_probs"], _ = self._forward_only("ref", batch, ModelOutput("log_probs"))
        ref = result.get("ref_log_probs", batch.ref_log_probs)
        old = batch.rollout_log_probs if args.use_rollout_logprobs else result.get("log_probs", batch.log_probs)
        if args.kl_coef != 0 and old is not None and ref is not None:
            result["kl"] = [algo.compute_approx_kl(o, r, args.kl_loss_type) for o, r in zip(old, ref)]
        else:
            result["kl"] = [torch.zeros(int(n)) for n in batch.response_lengths]
        return result

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Critic only: V_old per sample over its response tokens (position predicting each token)."""
        if self.role != "critic":
            raise RuntimeError("compute_values is a critic method (TrainWorker(args, role='critic'))")
        values, _ = self._forward_only("model", batch, ModelOutput("values"))
        return values

    # ------------------------------------------------------------------ advantages

    def _compute_advantages(self, batch: TrainBatch) -> TrainBatch:
        args = self.args
        masks = [m.float() for m in batch.loss_masks]
        if args.custom_advantage_function_path:
            view = batch.as_rollout_data()  # docs/INTERFACES.md §2.21: the hook sets rollout_data["advantages"] / ["returns"]
            load_function(args.custom_advantage_function_path)(args, view)
            batch = batch.with_rollout_data(view)
        else:
            raw = torch.tensor([float(batch.raw_reward[p]) for p in batch.partition])
            advantages, returns = algo.compute_advantages_and_returns(
                args.advantage_estimator,
                rewards=torch.tensor([float(r) for r in batch.rewards]),
                raw_rewards=raw, kl=batch.kl, loss_masks=masks, values=batch.values,
                kl_coef=args.kl_coef, gamma=args.gamma, lambd=args.lambd,
            )
            batch = batch.replace(advantages=advantages, returns=returns)
        if args.use_opd:
            old = batch.log_probs if not args.use_rollout_logprobs else batch.rollout_log_probs
            advantages, reverse_kl = algo.apply_opd(batch.advantages, old, batch.teacher_log_probs, args.opd_kl_coef)
            batch = batch.replace(advantages=advantages, opd_reverse_kl=reverse_kl)
        if args.normalize_advantages:
            sums = algo.whitening_sums(batch.advantages, masks)
            dist.all_reduce(sums)
            sums /= self.layout.replica_size  # every sample counted once
            batch = batch.replace(advantages=algo.whiten_with_sums(batch.advantages, sums))
        return batch

    # ------------------------------------------------------------------ training

    def prepare(self, rollout_id: int, batch: TrainBatch) -> TrainBatch:
        """Steps 1–3 of a rollout step (forward-only passes, KL, advantages/returns, the
        postprocess hook); returns the completed record (the given one is not modified)."""
        if self.backend.offloaded:
            self.backend.onload()
        args = self.args
        if self.role == "actor":
            if args.compute_advantages_and_returns and args.loss_type != "sft_loss":
                batch = batch.replace(**self.compute_log_probs(batch, skip_old=self.skips_old_log_prob_pass(batch)))
                batch = self._compute_advantages(batch)
        else:
            if batch.values is None:
                batch = batch.replace(values=self.compute_values(batch))
            if batch.kl is None:
                batch = batch.replace(kl=[torch.zeros(int(n)) for n in batch.response_lengths])
            if args.kl_coef != 0 and all(float(k.abs().sum()) == 0 for k in batch.kl):
                raise ValueError("critic.train with --kl-coef != 0 needs the kl column from actor.compute_log_probs")
            batch = self._compute_advantages(batch)
        if self.role == "actor" and args.rollout_data_postprocess_path:
            view = batch.as_rollout_data()  # docs/INTERFACES.md §2.9: mutated in place by the hook
            load_function(args.rollout_data_postprocess_path)(args, rollout_id, view)
            batch = batch.with_rollout_data(view)
        return batch

    def train(self, rollout_id: int, batch: TrainBatch) -> dict[str, float]:
        """One rollout step on this rank's data-parallel shard; returns metrics reduced over all ranks.

        Returned keys: ``rollout/<key>`` (trainer-side data), ``train/<key>`` (mean over this rollout
        step's optimizer steps; per-step values with ``train/step`` are in :meth:`get_step_metrics`),
        ``train/grad_norm``, ``train/lr-pg_<k>``, ``perf/<role>_train_time``,
        ``perf/<role>_train_tok_per_s``, ``perf/<role>_train_tflops`` (per rank). Critic keys carry the
        ``critic-`` tag (``train/critic-value_loss``).
        """
        self.profiler.rollout_id = rollout_id
        with self.profiler.phase("train_overall"):
            metrics = self._train(rollout_id, batch)
        self.profiler.step_done(rollout_id)
        return metrics

    def _train(self, rollout_id: int, batch: TrainBatch) -> dict[str, float]:
        try:
            batch = self.prepare(rollout_id, batch)
            if self.backend.has_model("old_actor"):  # π_old of the next rollout step: these weights, before this update
                self.backend.copy_weights("model", "old_actor")
            if self.role == "actor" and self.args.save_debug_train_data:
                from slime.observability.train_data_utils import save_debug_train_data

                save_debug_train_data(self.args.save_debug_train_data, rollout_id, batch.as_rollout_data())
            metrics = self.rollout_metrics(batch) if self.role == "actor" else {}
            with self.profiler.phase("train_actor"):
                metrics.update(self._train_steps(rollout_id, batch))
        finally:
            self.backend.finish_rollout_step()
        args = self.args
        if self.role == "actor" and args.ref_update_interval and (rollout_id + 1) % args.ref_update_interval == 0:
            self.update_ref_model()
        if args.reset_optimizer_states:
            self.backend.reset_optimizer_state()
        return metrics

    def step_normaliser(self, batch: TrainBatch, step_id: int) -> float:
        """B (rollouts in the step) or, per-token mode, the step's total loss-token count (docs/INTERFACES.md §5.8)."""
        if self.args.calculate_per_token_loss:
            return float(batch.schedule.step_loss_token_counts[step_id])
        return float(batch.schedule.global_batch_sizes[step_id])

    def forward_backward(self, batch: TrainBatch, step_id: int):
        """Accumulate the gradients of optimizer step ``step_id``; returns (metric sums of this rank,
        tokens, flops). Each micro-batch's loss is S(ℓ)/normaliser; the backend rescales it for its
        gradient averaging so that the reduced gradient is that of Σ S / normaliser."""
        normaliser = self.step_normaliser(batch, step_id)
        micro_batches = batch.schedule.micro_batches(step_id)

        def loss_fn(micro_batch: list[int], outputs):
            loss, metrics = self.loss(batch, micro_batch, outputs)
            return loss / normaliser, metrics_to_host(metrics)

        sums: dict[str, torch.Tensor] = {}
        for metrics in self.backend.forward_backward(batch, micro_batches, self.loss.output, loss_fn):
            for key, value in metrics.items():
                sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + value
        tokens, flops = self._work(batch, micro_batches)
        return sums, tokens, flops

    def _work(self, batch: TrainBatch, micro_batches: list[list[int]]) -> tuple[int, float]:
        """(tokens, training FLOPs) of the micro-batches (:mod:`~slime.backends.training.flops`)."""
        if self._flop_shape is None:
            self._flop_shape = FlopShape.from_hf_config(self.backend.hf_config(), self.role)
        tokens, flops = 0, 0.0
        all_positions = self.loss.output.kind == "logits"
        for micro_batch in micro_batches:
            lengths = [int(batch.tokens[i].numel()) for i in micro_batch]
            predicted = sum(lengths) - len(lengths) if all_positions else sum(int(batch.response_lengths[i]) for i in micro_batch)
            tokens += sum(lengths)
            flops += training_flops(self._flop_shape, lengths, predicted)
        return tokens, flops

    def _train_steps(self, rollout_id: int, batch: TrainBatch) -> dict[str, float]:
        args, backend = self.args, self.backend
        tag = "" if self.role == "actor" else "critic-"  # docs/INTERFACES.md §5.5: critic metrics carry the role tag
        hook = args.custom_megatron_before_train_step_hook_path
        hook = load_function(hook) if hook else None
        start_time, tokens_done, flops_done = time.perf_counter(), 0, 0.0
        step_results = []
        for step_id in range(batch.schedule.num_steps):
            if hook is not None:
                hook(args, rollout_id, step_id, backend.model, backend.optimizer, backend.scheduler)
            backend.zero_grad()
            sums, tokens, flops = self.forward_backward(batch, step_id)
            tokens_done, flops_done = tokens_done + tokens, flops_done + flops
            grad_norm, lrs = backend.optimizer_step()
            reduced = self.reduce_sums(sums, self.step_normaliser(batch, step_id))
            step_metrics = {f"train/{tag}{k}": v for k, v in reduced.items()}
            step_metrics[f"train/{tag}grad_norm"] = float(grad_norm)
            for k, lr in enumerate(lrs):
                step_metrics[f"train/{tag}lr-pg_{k}"] = float(lr)
            step_metrics["train/step"] = float(backend.global_step)
            backend.global_step += 1
            step_results.append(step_metrics)
        self.step_metrics = step_results
        elapsed = time.perf_counter() - start_time
        totals = torch.tensor([tokens_done, flops_done], dtype=torch.float64, device=self._device())
        dist.all_reduce(totals)
        totals = totals.cpu() / self.layout.replica_size  # a replica's ranks process the same tokens together
        out = {k: sum(s[k] for s in step_results) / len(step_results) for k in step_results[0] if k != "train/step"}
        out[f"perf/{self.role}_train_time"] = elapsed
        out[f"perf/{self.role}_train_tok_per_s"] = float(totals[0]) / elapsed
        out[f"perf/{self.role}_train_tflops"] = float(totals[1]) / elapsed / self.world_size / 1e12
        return out

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def reduce_sums(self, sums: dict[str, torch.Tensor], normaliser: float) -> dict[str, float]:
        return metrics_lib.reduce_sums(sums, normaliser, self.layout)

    def rollout_metrics(self, batch: TrainBatch) -> dict[str, float]:
        return metrics_lib.rollout_metrics(batch, self.layout, self._device(),
                                           correct_entropy=self.args.log_correct_samples)

    def get_step_metrics(self) -> list[dict[str, float]]:
        """Per-optimizer-step metrics of the last ``train`` call (each with ``train/step``)."""
        return list(self.step_metrics)

    # ------------------------------------------------------------------ models, checkpoints, weights

    def update_ref_model(self) -> None:
        """Copy the actor's weights into the reference model (``--ref-update-interval``)."""
        if self.backend.has_model("ref"):
            self.backend.copy_weights("model", "ref")

    def save(self, rollout_id: int) -> None:
        """Checkpoint of model, optimizer, schedule, RNG and step under ``--save`` (critic: ``<save>/critic``)."""
        self.backend.save(rollout_id)

    def wait_for_save(self) -> None:
        """Wait for a checkpoint still being written (``--async-save``); re-raises a failed write."""
        self.backend.wait_for_save()

    def save_hf(self, path: str) -> None:
        """HF directory (safetensors + config + tokenizer), written by rank 0; collective."""
        self.backend.save_hf(path)

    def iter_weight_buckets(self, bucket_bytes: int | None = None, dtype: torch.dtype | None = None
                            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors in buckets of about ``bucket_bytes`` (default
        ``--update-weight-buffer-size``). Collective: every rank must iterate to the end; every rank
        receives the full tensors, so any rank can send them."""
        if self.role != "actor":
            raise RuntimeError("iter_weight_buckets is an actor method: engines take the actor's weights, not the critic's")
        named = self.backend.named_hf_weights(dtype if dtype is not None else self.backend.weight_dtype())
        yield from bucket_weights(named, bucket_bytes or self.args.update_weight_buffer_size)

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (colocation)."""
        self.backend.offload()

    def onload(self) -> None:
        """Bring parameters, gradients and optimizer state back to the training device."""
        self.backend.onload()

    def begin_offload(self) -> None:
        """Start the part of the offload the weight push does not wait for (``Backend.begin_offload``)."""
        self.backend.begin_offload()

"""The FSDP2 training worker: one per rank, plain Python (the Ray actor that hosts it lives in slime/ray).

Used in a process where ``torch.distributed`` is initialised (gloo on CPU, NCCL on GPU); every
method is collective (all ranks call it) and takes/returns picklable values.

Rollout step, actor (``train``):
  1. forward-only passes over this rank's micro-batches: π_old log-probs (unless
     ``--use-rollout-logprobs``), reference log-probs (``--use-kl-loss`` / ``--kl-coef``), entropy
     (``--use-rollout-entropy``); skipped for keys already present in ``rollout_data``;
  2. shaping KL, advantages and returns (``--custom-advantage-function-path`` or the estimator),
     OPD, whitening over the DP group;
  3. ``--rollout-data-postprocess-path`` hook ``(args, rollout_id, rollout_data)``;
  4. one optimizer step per ``global_batch_sizes`` entry: the before-train-step hook, forward and
     backward of each micro-batch with the loss scaled so that the step objective is exactly §5.8
     (per-rollout: Σ S / B; per-token: Σ S / tokens) whatever the micro-batch split and DP size,
     ``--clip-grad``, AdamW, lr schedule.

PPO (``--advantage-estimator ppo``), the critic API — a second worker with ``role="critic"``:
  ``values = critic.compute_values(data)`` (V_old, per sample over the response),
  ``data["values"] = values``; with ``--kl-coef`` ≠ 0 also ``data.update(actor.compute_log_probs(data))``
  so both sides see the same KL; then ``critic.train(rollout_id, data)`` (computes the GAE returns
  itself and fits V to them) and ``actor.train(rollout_id, data)`` (same advantages). For the first
  ``--num-critic-only-steps`` rollout steps the caller skips ``actor.train``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist

from slime.backends.fsdp_utils import checkpoint as ckpt
from slime.backends.fsdp_utils.logprob_head import Nucleus, resolve_chunk_rows
from slime.backends.fsdp_utils.model import (
    forward_log_probs,
    forward_response_logits,
    load_model,
    pack_samples,
    resolve_attn_implementation,
    shard_model,
)
from slime.backends.fsdp_utils.optim import LRScheduler, build_optimizer
from slime.utils import ppo_utils
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

__all__ = ["FSDPTrainWorker"]

TOKEN_WEIGHTED_KEYS = ("log_probs", "ref_log_probs", "rollout_log_probs", "returns", "advantages", "values",
                       "teacher_log_probs", "opd_reverse_kl")
PLAIN_MEAN_KEYS = ("rewards", "response_lengths", "total_lengths", "truncated", "kl", "entropy")


class FSDPTrainWorker:
    """One rank of the actor (``role="actor"``) or critic (``role="critic"``) FSDP2 trainer."""

    def __init__(self, args, role: str = "actor"):
        if role not in ("actor", "critic"):
            raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")
        if not dist.is_initialized():
            raise RuntimeError("FSDPTrainWorker needs torch.distributed initialised (gloo on CPU, NCCL on GPU)")
        _reject_unsupported(args)
        self.args, self.role = args, role
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.attn_implementation = resolve_attn_implementation(getattr(args, "fsdp_attn_implementation", "auto"), self.device.type)
        precision = getattr(args, "fsdp_mixed_precision", "auto")
        self.mixed_precision = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        self.chunk_rows = resolve_chunk_rows(getattr(args, "log_probs_chunk_size", -1))
        self.model = self.ref_model = self.old_actor = self.optimizer = self.scheduler = None
        self.forward_only_passes = 0  # forward-only passes over a rollout's data (π_old, reference)
        self.global_step = 0
        self.step_metrics: list[dict[str, float]] = []
        self.offloaded = False

    # ------------------------------------------------------------------ set-up

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,))

    def _build(self, path: str, trainable: bool = True) -> torch.nn.Module:
        model = load_model(path, self.role, self.attn_implementation, self.args.seed)
        if trainable:
            _apply_freeze_lists(model, self.args)
        else:
            model.requires_grad_(False)
        if getattr(self.args, "gradient_checkpointing", False):
            model.gradient_checkpointing_enable() if self.role == "actor" else model.model.gradient_checkpointing_enable()
        model.to(self.device)
        # one rank: the trained model keeps its unsharded (bf16) parameters from forward to backward
        # instead of gathering them twice (a host-side cost per layer; no memory is saved by resharding)
        return shard_model(model, self._mesh(), self.mixed_precision, reshard_after_forward=not trainable or self.world_size > 1,
                           compile_layers=getattr(self.args, "fsdp_compile", False))

    def _checkpoint_dir(self, root: str | None) -> str | None:
        if root is None:
            return None
        return root if self.role == "actor" else os.path.join(root, "critic")

    def init(self) -> int | None:
        """Load ``--hf-checkpoint`` (or an HF ``--load``), or resume from a DCP ``--load``; build the
        reference model when needed. Returns the rollout id to start from (checkpoint + 1) or None."""
        args = self.args
        if getattr(args, "hf_checkpoint", None) is None:
            raise ValueError("--train-backend fsdp needs --hf-checkpoint (model architecture and tokenizer)")
        load_dir = self._checkpoint_dir(getattr(args, "load", None))
        weights = args.hf_checkpoint
        if self.role == "critic":
            weights = getattr(args, "critic_hf_checkpoint", None) or weights
        elif getattr(args, "load", None) and ckpt.is_hf_dir(args.load):
            weights = args.load
        torch.manual_seed(args.seed)
        self.model = self._build(weights)
        self.model.train()
        lr = args.lr if self.role == "actor" else (getattr(args, "critic_lr", None) or args.lr)
        self.optimizer = build_optimizer(self.model, args, lr)
        steps_per_rollout = max(args.rollout_batch_size * args.n_samples_per_prompt // max(args.global_batch_size, 1), 1)
        total_steps = (getattr(args, "num_rollout", None) or 1) * steps_per_rollout
        self.scheduler = LRScheduler(self.optimizer, args, lr, total_steps)
        if self.role == "actor" and (args.use_kl_loss or args.kl_coef != 0):
            ref = args.ref_load if ckpt.is_hf_dir(getattr(args, "ref_load", None)) else args.hf_checkpoint
            self.ref_model = self._build(ref, trainable=False)
            self.ref_model.eval()
            self._park_ref()
        if self.role == "actor" and getattr(args, "keep_old_actor", False):
            if getattr(args, "use_rollout_logprobs", False):
                raise ValueError("--keep-old-actor computes π_old with the pre-update actor, --use-rollout-logprobs takes "
                                 "π_old from the engine: use one of them")
            self.old_actor = self._build(weights, trainable=False)
            self.old_actor.eval()
        start = None
        if load_dir and os.path.isfile(os.path.join(load_dir, ckpt.LATEST_FILE)):
            iteration = ckpt.load_checkpoint(self, load_dir, getattr(args, "no_load_optim", False), getattr(args, "no_load_rng", False))
            start = iteration + 1
        if self.old_actor is not None and not getattr(self, "_old_actor_loaded", False):
            _copy_weights(self.model, self.old_actor)
        self._park(self.old_actor)
        dist.barrier()
        return start

    def _park_ref(self) -> None:
        """Keep the idle reference model in host memory (GPU only; on CPU it already is)."""
        self._park(self.ref_model)

    def _park(self, model) -> None:
        if model is not None and self.device.type == "cuda":
            model.to("cpu")
            torch.cuda.empty_cache()

    def _forward_parked(self, model, rollout_data: dict, **kwargs):
        """A forward-only pass of a model kept in host memory: moved to the device for it, then back."""
        if self.device.type == "cuda":
            model.to(self.device)
        try:
            return self._forward_only(model, rollout_data, **kwargs)
        finally:
            self._park(model)

    # ------------------------------------------------------------------ forward passes

    def _micro_batches(self, rollout_data: dict) -> list[list[int]]:
        return rollout_data["micro_batch_indices"]

    def _pack(self, rollout_data: dict, micro_batch: list[int]):
        tokens = [rollout_data["tokens"][i] for i in micro_batch]
        lengths = [int(rollout_data["response_lengths"][i]) for i in micro_batch]
        return pack_samples(tokens, lengths, self.device)

    def _nucleus(self, rollout_data: dict, micro_batch: list[int]) -> Nucleus | None:
        """The engine's kept top-p sets of the micro-batch's response positions (``--rollout-top-p`` ≠ 1)."""
        if getattr(self.args, "rollout_top_p", 1.0) == 1.0:
            return None
        all_ids, all_offsets = rollout_data.get("rollout_top_p_token_ids"), rollout_data.get("rollout_top_p_token_offsets")
        if all_ids is None or all_offsets is None:
            raise ValueError("--rollout-top-p != 1 needs rollout_top_p_token_ids and rollout_top_p_token_offsets in the "
                             "train data (the engine's nucleus per position; INTERFACES §1 fields 17-18, §2.14)")
        ids, offsets, base = [], [torch.zeros(1, dtype=torch.long)], 0
        for i in micro_batch:
            sample_ids = torch.as_tensor(all_ids[i]).long()
            sample_offsets = torch.as_tensor(all_offsets[i]).long()
            response = int(rollout_data["response_lengths"][i])
            name = f"sample {rollout_data['sample_indices'][i]}" if "sample_indices" in rollout_data else f"sample {i}"
            if (sample_offsets.numel() != response + 1 or int(sample_offsets[0]) != 0
                    or int(sample_offsets[-1]) != sample_ids.numel() or bool((sample_offsets.diff() < 0).any())):
                raise ValueError(f"{name}: rollout_top_p_token_offsets must have response_length + 1 = {response + 1} "
                                 f"non-decreasing entries from 0 to the id count {sample_ids.numel()}, got "
                                 f"{sample_offsets.tolist()[:8]}{'...' if sample_offsets.numel() > 8 else ''} "
                                 f"({sample_offsets.numel()} entries)")
            if sample_ids.numel() and (int(sample_ids.min()) < 0 or int(sample_ids.max()) >= self._vocab_size()):
                raise ValueError(f"{name}: rollout_top_p_token_ids outside the vocabulary [0, {self._vocab_size()})")
            ids.append(sample_ids)
            offsets.append(sample_offsets[1:] + base)
            base += sample_ids.numel()
        return Nucleus(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long), torch.cat(offsets), self.device)

    def _vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @torch.no_grad()
    def _forward_only(self, model, rollout_data: dict, with_entropy: bool = False, values: bool = False):
        """Per-sample log-probs (and entropy), or values, over the same micro-batches as training
        (so the first step's recomputed π_old equals the training forward bit for bit)."""
        self.forward_only_passes += 1
        n = len(rollout_data["tokens"])
        out: list = [None] * n
        entropy_out: list = [None] * n
        temperature = self.args.rollout_temperature
        for micro_batch in self._micro_batches(rollout_data):
            packed = self._pack(rollout_data, micro_batch)
            if packed.predict_positions.numel() == 0:
                for i in micro_batch:
                    out[i] = torch.zeros(0)
                    entropy_out[i] = torch.zeros(0)
                continue
            if values:
                per_token, entropy = forward_response_logits(model, packed, self.attn_implementation).float(), None
            else:
                per_token, entropy = forward_log_probs(model, packed, self.attn_implementation, temperature, self.chunk_rows,
                                                       self._nucleus(rollout_data, micro_batch))
            # one device-to-host copy per micro-batch, split on the host
            for j, piece in zip(micro_batch, torch.split(per_token.detach().float().cpu(), packed.response_lengths)):
                out[j] = piece
            if with_entropy:
                for j, piece in zip(micro_batch, torch.split(entropy.detach().float().cpu(), packed.response_lengths)):
                    entropy_out[j] = piece
        _reshard(model)
        return out, (entropy_out if with_entropy else None)

    def skips_old_log_prob_pass(self, rollout_data: dict) -> bool:
        """§5: with exactly one optimizer step in this rollout step and nothing else needing π_old
        from a separate pass, the loss uses log π_old = stopgrad(log π_θ) (ratio ≡ 1, the same
        loss and gradients) and the forward-only π_old pass is skipped. Custom advantage and
        rollout-data hooks may read ``log_probs``, and the train debug dump (§7.6) records them, so
        they keep the pass."""
        args = self.args
        return (
            self.role == "actor"
            and args.loss_type == "policy_loss"
            and len(rollout_data["num_microbatches"]) == 1
            and args.kl_coef == 0
            and not getattr(args, "use_rollout_logprobs", False)
            and not getattr(args, "get_mismatch_metrics", False)
            and not getattr(args, "use_rollout_entropy", False)
            and args.advantage_estimator not in ("ppo", "gspo")
            and not getattr(args, "keep_old_actor", False)
            and not getattr(args, "use_opd", False)
            and not getattr(args, "use_routing_replay", False)
            and not getattr(args, "custom_advantage_function_path", None)
            and not getattr(args, "rollout_data_postprocess_path", None)
            and not getattr(args, "save_debug_train_data", None)
        )

    def compute_log_probs(self, rollout_data: dict, skip_old: bool = False) -> dict[str, list[torch.Tensor]]:
        """π_old log-probs (not with ``skip_old``: see :meth:`skips_old_log_prob_pass`), reference
        log-probs and the shaping KL (§5.2) for this rank's samples."""
        args = self.args
        result: dict[str, list[torch.Tensor]] = {}
        if "log_probs" not in rollout_data and not getattr(args, "use_rollout_logprobs", False) and not skip_old:
            with_entropy = getattr(args, "use_rollout_entropy", False)
            if self.old_actor is not None:  # --keep-old-actor: π_old = the actor before the last update
                result["log_probs"], entropy = self._forward_parked(self.old_actor, rollout_data, with_entropy=with_entropy)
            else:
                result["log_probs"], entropy = self._forward_only(self.model, rollout_data, with_entropy=with_entropy)
            if entropy is not None:
                result["entropy"] = entropy
        if self.ref_model is not None and "ref_log_probs" not in rollout_data:
            result["ref_log_probs"], _ = self._forward_parked(self.ref_model, rollout_data)
        merged = {**rollout_data, **result}
        old = merged.get("log_probs") if not getattr(args, "use_rollout_logprobs", False) else merged.get("rollout_log_probs")
        if args.kl_coef != 0 and old is not None and merged.get("ref_log_probs") is not None:
            result["kl"] = [ppo_utils.compute_approx_kl(o, r, args.kl_loss_type) for o, r in zip(old, merged["ref_log_probs"])]
        else:
            result["kl"] = [torch.zeros(int(n)) for n in rollout_data["response_lengths"]]
        return result

    def compute_values(self, rollout_data: dict) -> list[torch.Tensor]:
        """Critic only: V_old per sample over its response tokens (position predicting each token)."""
        if self.role != "critic":
            raise RuntimeError("compute_values is a critic method (FSDPTrainWorker(args, role='critic'))")
        values, _ = self._forward_only(self.model, rollout_data, values=True)
        return values

    # ------------------------------------------------------------------ advantages

    def _compute_advantages(self, rollout_id: int, rollout_data: dict) -> None:
        args = self.args
        masks = [m.float() for m in rollout_data["loss_masks"]]
        if getattr(args, "custom_advantage_function_path", None):
            load_function(args.custom_advantage_function_path)(args, rollout_data)
        else:
            raw = torch.tensor([float(rollout_data["raw_reward"][p]) for p in rollout_data["partition"]])
            advantages, returns = ppo_utils.compute_advantages_and_returns(
                args.advantage_estimator,
                rewards=torch.tensor([float(r) for r in rollout_data["rewards"]]),
                raw_rewards=raw, kl=rollout_data["kl"], loss_masks=masks, values=rollout_data.get("values"),
                kl_coef=args.kl_coef, gamma=args.gamma, lambd=args.lambd,
            )
            rollout_data["advantages"], rollout_data["returns"] = advantages, returns
        if getattr(args, "use_opd", False):
            teacher = rollout_data.get("teacher_log_probs")
            old = rollout_data.get("log_probs") if not args.use_rollout_logprobs else rollout_data.get("rollout_log_probs")
            rollout_data["advantages"], rollout_data["opd_reverse_kl"] = ppo_utils.apply_opd(
                rollout_data["advantages"], old, teacher, args.opd_kl_coef
            )
        if args.normalize_advantages:
            sums = ppo_utils.whitening_sums(rollout_data["advantages"], masks)
            dist.all_reduce(sums)
            rollout_data["advantages"] = ppo_utils.whiten_with_sums(rollout_data["advantages"], sums)

    # ------------------------------------------------------------------ training

    def prepare(self, rollout_id: int, rollout_data: dict) -> dict:
        """Steps 1–3 of a rollout step (forward-only passes, KL, advantages/returns, the
        postprocess hook) on a shallow copy of ``rollout_data``; returns the completed dict."""
        if self.offloaded:
            self.onload()
        args = self.args
        rollout_data = dict(rollout_data)
        rollout_data.setdefault("total_lengths_local", [int(t.numel()) for t in rollout_data["tokens"]])
        if self.role == "actor":
            if getattr(args, "compute_advantages_and_returns", True) and args.loss_type != "sft_loss":
                rollout_data.update(self.compute_log_probs(rollout_data, skip_old=self.skips_old_log_prob_pass(rollout_data)))
                self._compute_advantages(rollout_id, rollout_data)
        else:
            if "values" not in rollout_data:
                rollout_data["values"] = self.compute_values(rollout_data)
            rollout_data.setdefault("kl", [torch.zeros(int(n)) for n in rollout_data["response_lengths"]])
            if args.kl_coef != 0 and all(float(k.abs().sum()) == 0 for k in rollout_data["kl"]):
                raise ValueError("critic.train with --kl-coef != 0 needs rollout_data['kl'] from actor.compute_log_probs")
            self._compute_advantages(rollout_id, rollout_data)
        if self.role == "actor" and getattr(args, "rollout_data_postprocess_path", None):
            load_function(args.rollout_data_postprocess_path)(args, rollout_id, rollout_data)
        return rollout_data

    def train(self, rollout_id: int, rollout_data: dict) -> dict[str, float]:
        """One rollout step on this rank's DP-local dict; returns metrics reduced over all ranks.

        Returned keys: ``rollout/<key>`` (trainer-side data), ``train/<key>`` (mean over this rollout
        step's optimizer steps; per-step values with ``train/step`` are in :meth:`get_step_metrics`),
        ``train/grad_norm``, ``train/lr-pg_<k>``, ``perf/<role>_train_time``,
        ``perf/<role>_train_tok_per_s``, ``perf/<role>_train_tflops`` (per rank). Critic keys carry the
        ``critic-`` tag (``train/critic-value_loss``).
        """
        rollout_data = self.prepare(rollout_id, rollout_data)
        if self.old_actor is not None:  # π_old of the next rollout step: these weights, before this update
            _copy_weights(self.model, self.old_actor)
        if self.role == "actor" and getattr(self.args, "save_debug_train_data", None):
            from slime.observability.train_data_utils import save_debug_train_data

            save_debug_train_data(self.args.save_debug_train_data, rollout_id, rollout_data)
        metrics = self._rollout_metrics(rollout_data) if self.role == "actor" else {}
        metrics.update(self._train_steps(rollout_id, rollout_data))
        args = self.args
        if self.role == "actor" and getattr(args, "ref_update_interval", None) and (rollout_id + 1) % args.ref_update_interval == 0:
            self.update_ref_model()
        if getattr(args, "reset_optimizer_states", False):
            self.optimizer.state.clear()
        return metrics

    def step_normaliser(self, rollout_data: dict, step_id: int) -> float:
        """B (rollouts in the step) or, per-token mode, the step's total loss-token count (§5.8)."""
        if self.args.calculate_per_token_loss:
            return float(rollout_data["step_loss_token_counts"][step_id])
        return float(rollout_data["global_batch_sizes"][step_id])

    def forward_backward(self, rollout_data: dict, step_id: int):
        """Accumulate the gradients of optimizer step ``step_id``; returns (metric sums of this rank,
        tokens, flops). Gradients are left in ``.grad`` (the optimizer step is separate)."""
        counts = rollout_data["num_microbatches"]
        first = sum(counts[:step_id])
        normaliser = self.step_normaliser(rollout_data, step_id)
        sums: dict[str, torch.Tensor] = {}
        tokens_done, flops_done = 0, 0.0
        for micro_batch in self._micro_batches(rollout_data)[first : first + counts[step_id]]:
            step_sums, tokens, flops = self._train_micro_batch(rollout_data, micro_batch, normaliser)
            tokens_done, flops_done = tokens_done + tokens, flops_done + flops
            if not step_sums:
                continue
            keys = list(step_sums)  # one device-to-host copy for all of the micro-batch's metric sums
            values = torch.stack([step_sums[k].detach().double().reshape(()) for k in keys]).cpu()
            for key, value in zip(keys, values):
                sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + value
        return sums, tokens_done, flops_done

    def _train_steps(self, rollout_id: int, rollout_data: dict) -> dict[str, float]:
        args = self.args
        tag = "" if self.role == "actor" else "critic-"
        hook = getattr(args, "custom_megatron_before_train_step_hook_path", None)
        hook = load_function(hook) if hook else None
        start_time, tokens_done, flops_done = time.perf_counter(), 0, 0.0
        step_results = []
        for step_id in range(len(rollout_data["num_microbatches"])):
            if hook is not None:
                hook(args, rollout_id, step_id, self.model, self.optimizer, self.scheduler)
            sums, tokens, flops = self.forward_backward(rollout_data, step_id)
            tokens_done, flops_done = tokens_done + tokens, flops_done + flops
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=args.clip_grad)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            lrs = self.scheduler.get_last_lr()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            reduced = self._all_reduce_sums(sums, self.step_normaliser(rollout_data, step_id))
            step_metrics = {f"train/{tag}{k}": v for k, v in reduced.items()}
            step_metrics[f"train/{tag}grad_norm"] = float(grad_norm)
            for k, lr in enumerate(lrs):
                step_metrics[f"train/{tag}lr-pg_{k}"] = lr
            step_metrics["train/step"] = float(self.global_step)
            self.global_step += 1
            step_results.append(step_metrics)
        self.step_metrics = step_results
        elapsed = time.perf_counter() - start_time
        totals = torch.tensor([tokens_done, flops_done], dtype=torch.float64)
        dist.all_reduce(totals)
        out = {k: sum(s[k] for s in step_results) / len(step_results) for k in step_results[0] if k != "train/step"}
        out[f"perf/{self.role}_train_time"] = elapsed
        out[f"perf/{self.role}_train_tok_per_s"] = float(totals[0]) / elapsed
        out[f"perf/{self.role}_train_tflops"] = float(totals[1]) / elapsed / self.world_size / 1e12
        return out

    def _all_reduce_sums(self, sums: dict[str, torch.Tensor], normaliser: float) -> dict[str, float]:
        # Every rank must reduce the same keys in the same order; a rank whose micro-batches were all
        # dummies has none, so the key set is agreed first.
        keys = sorted(sums)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, keys)
        keys = sorted(set().union(*gathered))
        values = torch.stack([sums.get(k, torch.zeros((), dtype=torch.float64)) for k in keys]) if keys else torch.zeros(0)
        dist.all_reduce(values)
        return {k: float(v) / normaliser for k, v in zip(keys, values)}

    def _micro_batch_fields(self, rollout_data: dict, micro_batch: list[int]) -> dict:
        batch = {}
        for key in ("loss_masks", "advantages", "returns", "values", "log_probs", "ref_log_probs", "rollout_log_probs",
                    "teacher_log_probs", "opd_reverse_kl", "tokens"):
            if rollout_data.get(key) is not None:
                batch[key] = [rollout_data[key][i] for i in micro_batch]
        batch["response_lengths"] = [int(rollout_data["response_lengths"][i]) for i in micro_batch]
        batch["total_lengths"] = [int(rollout_data["tokens"][i].numel()) for i in micro_batch]
        batch["rollout_mask_sums"] = [float(rollout_data["rollout_mask_sums"][i]) for i in micro_batch]
        return batch

    def _train_micro_batch(self, rollout_data: dict, micro_batch: list[int], normaliser: float):
        """Forward + backward of one micro-batch. The loss is S(ℓ)·dp/normaliser: FSDP averages
        gradients over the dp ranks, so the accumulated gradient is that of Σ S / normaliser."""
        args = self.args
        packed = self._pack(rollout_data, micro_batch)
        custom_loss = args.loss_type == "custom_loss" and self.role == "actor"
        scale = self.world_size / normaliser
        empty = packed.predict_positions.numel() == 0
        if self.role == "critic" or custom_loss:
            output = forward_response_logits(self.model, packed, self.attn_implementation, full=custom_loss)
            zero = output.float().sum() * 0.0
        else:
            log_probs, entropy = forward_log_probs(
                self.model, packed, self.attn_implementation, args.rollout_temperature, self.chunk_rows,
                None if empty else self._nucleus(rollout_data, micro_batch), entropy_grad=args.entropy_coef != 0,
            )
            zero = log_probs.sum() * 0.0
        if empty:
            zero.backward()  # every rank runs the same FSDP collectives, with or without tokens
            return {}, int(packed.input_ids.numel()) if not packed.dummy else 0, 0.0
        batch = self._micro_batch_fields(rollout_data, micro_batch)
        per_token = args.calculate_per_token_loss  # the reducer's weights are built on the host, copied once
        reducer = ppo_utils.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"],
                                                    per_token)
        if self.role == "critic":
            loss, metrics = ppo_utils.value_loss_function(args, batch, output.float(), reducer)
        elif custom_loss:
            batch.update(unconcat_tokens=batch["tokens"], tokens=packed.input_ids, packed_seq_params={"cu_seqlens": packed.cu_seqlens})
            loss, metrics = load_function(args.custom_loss_function_path)(args, batch, output.float()[None], reducer)
        elif args.loss_type == "sft_loss":
            loss, metrics = ppo_utils.sft_loss_function(args, batch, log_probs, reducer)
        else:
            loss, metrics = ppo_utils.policy_loss_function(
                args, batch, log_probs, entropy, reducer, self._pg_reducer(batch), self._tis_function()
            )
        (loss * scale).backward()
        tokens = int(packed.input_ids.numel())
        return metrics, tokens, self._flops(packed.lengths, int(packed.predict_positions.numel()))

    def _pg_reducer(self, batch: dict):
        path = getattr(self.args, "custom_pg_loss_reducer_function_path", None)
        if not path:
            return None
        return load_function(path)(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                   self.args.calculate_per_token_loss)

    def _tis_function(self):
        args = self.args
        if not (getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)):
            return None
        path = getattr(args, "custom_tis_function_path", None)
        return load_function(path) if path else ppo_utils.vanilla_tis_function

    def _flops(self, lengths: list[int], num_predicted: int) -> float:
        """Training FLOPs (forward + backward) of a packed micro-batch: 6·N_body per token (N_body:
        parameters outside the embedding), 6·V·H per predicted token for the LM head (only response
        positions are projected), causal attention 6·L·d·s² per sample."""
        if not hasattr(self, "_flop_shape"):
            config = getattr(self.model, "config", None) or self.model.model.config
            total = float(sum(p.numel() for p in self.model.parameters()))  # DTensor numel is global
            embed = float(config.vocab_size * config.hidden_size)
            attn_dim = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
            head = embed if self.role == "actor" else float(config.hidden_size)
            self._flop_shape = (total - embed - (0.0 if getattr(config, "tie_word_embeddings", False) or self.role != "actor" else embed),
                                head, config.num_hidden_layers, attn_dim)
        body, head, layers, attn_dim = self._flop_shape
        attention = sum(6.0 * layers * attn_dim * s * s for s in lengths)
        return 6.0 * body * sum(lengths) + 6.0 * head * num_predicted + attention

    def _mp_size(self) -> int:
        """Ranks that hold the same samples (a model-parallel group; 1 under FSDP)."""
        return 1

    def get_step_metrics(self) -> list[dict[str, float]]:
        """Per-optimizer-step metrics of the last ``train`` call (each with ``train/step``)."""
        return list(self.step_metrics)

    # ------------------------------------------------------------------ rollout metrics

    def _rollout_metrics(self, rollout_data: dict) -> dict[str, float]:
        """``rollout/<key>``: token-weighted per-rollout means for log-prob-like keys (Σ_i Σ_t x·m/D_i
        over all ranks ÷ number of rollouts), plain sample means for the rest (§5.9)."""
        keys, values = [], []
        # every rank of a model-parallel group holds the same samples (1 rank in FSDP) and every rank
        # the same global rollout count: weights that make the sum over all ranks count each once
        share = 1.0 / self._mp_size()
        num_rollouts = float(sum(rollout_data["global_batch_sizes"])) / self.world_size
        for key in TOKEN_WEIGHTED_KEYS:
            if rollout_data.get(key) is None:
                continue
            total = 0.0
            for x, m, d in zip(rollout_data[key], rollout_data["loss_masks"], rollout_data["rollout_mask_sums"]):
                total += float((torch.as_tensor(x).float() * m.float()).sum()) / max(float(d), 1.0)
            keys.append(key)
            values += [total * share, num_rollouts]
        sources = {"response_lengths": rollout_data["response_lengths"], "total_lengths": rollout_data["total_lengths_local"]}
        for key in (*PLAIN_MEAN_KEYS, "raw_reward"):
            column = sources.get(key, rollout_data.get(key))
            if column is None:
                continue
            per_sample = [float(torch.as_tensor(v).float().mean()) if torch.as_tensor(v).numel() else 0.0 for v in column]
            keys.append(key)
            values += [sum(per_sample) * share, len(per_sample) * share]
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, keys)
        if any(g != keys for g in gathered):
            raise RuntimeError(f"ranks disagree on rollout_data keys: {gathered}")
        reduced = torch.tensor(values, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(reduced)
        reduced = reduced.cpu()
        out = {}
        for i, key in enumerate(keys):
            total, count = reduced[2 * i], reduced[2 * i + 1]
            out[f"rollout/{key}"] = float(total / count) if count > 0 else 0.0
        return out

    # ------------------------------------------------------------------ reference model

    def update_ref_model(self) -> None:
        """Copy the actor's weights into the reference model (``--ref-update-interval``)."""
        if self.ref_model is not None:
            _copy_weights(self.model, self.ref_model)

    # ------------------------------------------------------------------ checkpoints and weights

    def save(self, rollout_id: int) -> None:
        """DCP checkpoint (model, optimizer, scheduler, RNG, step) under ``--save`` (critic: ``<save>/critic``)."""
        ckpt.save_checkpoint(self, self._checkpoint_dir(self.args.save), rollout_id)

    def save_hf(self, path: str) -> None:
        """HF directory (safetensors + config + tokenizer), written by rank 0; collective."""
        ckpt.save_hf(self, path)

    def iter_weight_buckets(self, bucket_bytes: int | None = None, dtype: torch.dtype | None = None
                            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield HF-named full tensors in buckets of about ``bucket_bytes`` (default
        ``--update-weight-buffer-size``). Collective: every rank must iterate to the end; every rank
        receives the full tensors (all-gathered from the shards), so any rank can send them."""
        yield from ckpt.iter_weight_buckets(self, bucket_bytes or self.args.update_weight_buffer_size, dtype)

    # ------------------------------------------------------------------ colocation

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (no-op on a CPU device)."""
        self._move("cpu")
        self.offloaded = True

    def onload(self) -> None:
        """Bring parameters, gradients and optimizer state back to the training device."""
        self._move(self.device)
        self.offloaded = False

    def _move(self, device) -> None:
        if torch.device(device).type == self.device.type == "cpu":
            return
        _reshard(self.model)
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            if torch.device(device).type == "cpu":
                torch.cuda.empty_cache()


def _reshard(model: torch.nn.Module) -> None:
    """Free the unsharded parameters a forward without backward leaves behind when the model does
    not reshard after forward (one rank): parameters read outside a pass are the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def _copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy ``source``'s parameters into ``target`` (same architecture and sharding) wherever
    ``target`` lives (a parked model stays in host memory): shard by shard, no gather."""
    targets = dict(target.named_parameters())
    for name, param in source.named_parameters():
        dst = targets[name]
        local_dst = dst.to_local() if hasattr(dst, "to_local") else dst
        local_src = param.to_local() if hasattr(param, "to_local") else param
        local_dst.copy_(local_src, non_blocking=False)


def _reject_unsupported(args) -> None:
    """Flags whose semantics this backend does not implement yet: fail early, naming them."""
    unsupported = {
        "--opd-type megatron (teacher model inside the trainer)": getattr(args, "use_opd", False)
        and getattr(args, "opd_type", None) == "megatron",
        "--use-routing-replay / --use-rollout-routing-replay (MoE)": getattr(args, "use_routing_replay", False),
        "--enable-mtp-training": getattr(args, "enable_mtp_training", False),
        "--multimodal-keys (multimodal training inputs)": bool(getattr(args, "multimodal_keys", None)),
    }
    names = [name for name, active in unsupported.items() if active]
    if names:
        raise NotImplementedError(f"--train-backend fsdp does not support {', '.join(names)} yet")


def _apply_freeze_lists(model: torch.nn.Module, args) -> None:
    """``--only-train-params-name-list`` / ``--freeze-params-name-list``: regexes on HF parameter names."""
    import re

    only = getattr(args, "only_train_params_name_list", None)
    freeze = getattr(args, "freeze_params_name_list", None)
    if not only and not freeze:
        return
    for name, param in model.named_parameters():
        if only:
            param.requires_grad_(any(re.search(p, name) for p in only))
        else:
            param.requires_grad_(not any(re.search(p, name) for p in freeze))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("--only-train-params-name-list / --freeze-params-name-list left no trainable parameter")

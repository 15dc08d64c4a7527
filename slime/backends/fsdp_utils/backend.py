"""The FSDP2 training backend: Hugging Face models sharded with ``fully_shard`` over all ranks.

Implements :class:`~slime.backends.training.backend.TrainBackend` for
:class:`~slime.backends.training.worker.TrainWorker`. Every rank is its own data-parallel shard
(``DataLayout(rank, world_size)``). Micro-batches are packed into one row (varlen attention on
CUDA, a block-causal mask elsewhere); log-probs come from the shared chunked head
(:mod:`slime.backends.training.logprob_head`), renormalised over the engine's nucleus under
``--rollout-top-p`` < 1. The reference model and the ``--keep-old-actor`` copy are parked in host
memory between their passes on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from slime.backends import batch_invariant
from slime.backends.fsdp_utils import checkpoint as ckpt
from slime.backends.fsdp_utils import vision
from slime.backends.fsdp_utils.model import (
    forward_log_probs,
    forward_response_logits,
    load_model,
    pack_samples,
    pad_samples,
    resolve_attn_implementation,
    shard_model,
)
from slime.backends.fsdp_utils.optim import LRScheduler, build_optimizer
from slime.backends.training.backend import DataLayout, ModelOutput, ModelOutputs, TrainBackend, apply_freeze_lists
from slime.backends.training.batch import TrainBatch
from slime.backends.training.logprob_head import Nucleus, resolve_chunk_rows
from slime.utils.multimodal import is_vision_language

logger = logging.getLogger(__name__)

__all__ = ["FSDPBackend"]


class FSDPBackend(TrainBackend):
    """One FSDP2 rank of the actor (``role="actor"``) or critic (``role="critic"``)."""

    def __init__(self, args, role: str = "actor"):
        super().__init__(args, role)
        if not dist.is_initialized():
            raise RuntimeError("the FSDP backend needs torch.distributed initialised (gloo on CPU, NCCL on GPU)")
        _reject_unsupported(args)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.layout = DataLayout(dp_rank=self.rank, dp_size=self.world_size)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        #: --true-on-policy: the engine's batch-invariant ops (slime/backends/batch_invariant.py) on this side too
        self.true_on_policy = args.true_on_policy
        self.attn_implementation = (batch_invariant.register() if self.true_on_policy else
                                    resolve_attn_implementation(args.fsdp_attn_implementation,
                                                                self.device.type))
        precision = args.fsdp_mixed_precision
        self.mixed_precision = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        self.chunk_rows = resolve_chunk_rows(args.log_probs_chunk_size)
        self.model = self.ref_model = self.old_actor = self.optimizer = self.scheduler = None
        # colocated offloading (offload / begin_offload / onload): the side stream the optimizer state copies
        # on, the event of its copy to the device, and the device tensors a copy to the host still reads
        self._stream, self._state_in, self._state_out = None, None, None
        self.routing = None  # HFRoutingReplay of the actor with --use-routing-replay (R2) / --use-rollout-routing-replay (R3)
        self._async_writer = None  # --async-save: the checkpoint written in the background
        self.offloaded = False
        self._old_actor_loaded = False

    # ------------------------------------------------------------------ set-up

    def _build(self, path: str, trainable: bool = True) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        model = load_model(path, self.role, self.attn_implementation, self.args.seed)
        if self.true_on_policy:
            compute_dtype = torch.bfloat16 if self.mixed_precision else torch.float32  # FSDP casts the parameters
            batch_invariant.check_supported(model, "--true-on-policy (FSDP trainer)", compute_dtype, self.device)
            batch_invariant.install(model)
        if trainable:
            apply_freeze_lists(model, self.args)
            if self.args.freeze_vision_tower:
                if not is_vision_language(model.config):
                    raise ValueError(f"--freeze-vision-tower: {path} has no vision tower (not a vision-language model)")
                vision.freeze_vision_tower(model)
        else:
            model.requires_grad_(False)
        if self.args.gradient_checkpointing:
            model.gradient_checkpointing_enable() if self.role == "actor" else model.model.gradient_checkpointing_enable()
        model.to(self.device)
        # one rank: the trained model keeps its unsharded (bf16) parameters from forward to backward
        # instead of gathering them twice (a host-side cost per layer; no memory is saved by resharding)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        return shard_model(model, mesh, self.mixed_precision, reshard_after_forward=not trainable or self.world_size > 1,
                           compile_layers=self.args.fsdp_compile)

    def _checkpoint_dir(self, root: str | None) -> str | None:
        if root is None:
            return None
        return root if self.role == "actor" else os.path.join(root, "critic")

    def init(self) -> int | None:
        """Load ``--hf-checkpoint`` (or an HF ``--load``), or resume from a DCP ``--load``; build the
        reference model and the old actor when needed. Returns the rollout id to start from or None."""
        args = self.args
        if args.hf_checkpoint is None:
            raise ValueError("--train-backend fsdp needs --hf-checkpoint (model architecture and tokenizer)")
        load_dir = self._checkpoint_dir(args.load)
        weights = args.hf_checkpoint
        if self.role == "critic":
            weights = args.critic_hf_checkpoint or weights
        elif args.load and ckpt.is_hf_dir(args.load):
            weights = args.load
        torch.manual_seed(args.seed)
        self.model = self._build(weights)
        self.model.train()
        if args.use_routing_replay and self.role == "actor":
            from slime.backends.fsdp_utils.routing_replay import HFRoutingReplay

            self.routing = HFRoutingReplay(self.model)
        lr = args.lr if self.role == "actor" else (args.critic_lr or args.lr)
        self.optimizer = build_optimizer(self.model, args, lr)
        steps_per_rollout = max(args.rollout_batch_size * args.n_samples_per_prompt // max(args.global_batch_size, 1), 1)
        total_steps = (args.num_rollout or 1) * steps_per_rollout
        self.scheduler = LRScheduler(self.optimizer, args, lr, total_steps)
        if self.role == "actor" and (args.use_kl_loss or args.kl_coef != 0):
            ref = args.ref_load if ckpt.is_hf_dir(args.ref_load) else args.hf_checkpoint
            self.ref_model = self._build(ref, trainable=False)
            self.ref_model.eval()
            self._park(self.ref_model)
        if self.role == "actor" and args.keep_old_actor:
            if args.use_rollout_logprobs:
                raise ValueError("--keep-old-actor computes π_old with the pre-update actor, --use-rollout-logprobs takes "
                                 "π_old from the engine: use one of them")
            self.old_actor = self._build(weights, trainable=False)
            self.old_actor.eval()
        start = None
        if load_dir and os.path.isfile(os.path.join(load_dir, ckpt.LATEST_FILE)):
            iteration = ckpt.load_checkpoint(self, load_dir, args.no_load_optim, args.no_load_rng)
            start = iteration + 1
        if self.old_actor is not None and not self._old_actor_loaded:
            _copy_weights(self.model, self.old_actor)
        self._park(self.old_actor)
        dist.barrier()
        return start

    def _models(self) -> dict:
        return {"model": self.model, "ref": self.ref_model, "old_actor": self.old_actor}

    def has_model(self, which: str) -> bool:
        return self._models()[which] is not None

    def _park(self, model) -> None:
        """Keep an idle frozen model in host memory (GPU only; on CPU it already is)."""
        if model is not None and self.device.type == "cuda":
            model.to("cpu")
            torch.cuda.empty_cache()

    def hf_config(self) -> dict:
        config = getattr(self.model, "config", None) or self.model.model.config
        return config.to_dict()

    # ------------------------------------------------------------------ forward passes

    def _pack(self, batch: TrainBatch, micro_batch: list[int], output: ModelOutput):
        """The micro-batch's layout: padded rows under sdpa (causal, no mask), one packed row otherwise
        and whenever full-position logits are asked for (a custom loss sees the packed sequence)."""
        tokens = [batch.tokens[i] for i in micro_batch]
        lengths = [int(batch.response_lengths[i]) for i in micro_batch]
        if self.attn_implementation in ("sdpa", batch_invariant.ATTENTION_NAME) and output.kind != "logits":
            packed = pad_samples(tokens, lengths, self.device)
        else:
            packed = pack_samples(tokens, lengths, self.device)
        if micro_batch and self.role == "actor" and is_vision_language(self.model.config):  # images, M-RoPE positions
            inputs = batch.multimodal_train_inputs or [None] * len(batch.tokens)
            names = [f"sample {batch.sample_indices[i] if batch.sample_indices is not None else i}" for i in micro_batch]
            vision.attach(self.model, packed, tokens, lengths, [inputs[i] for i in micro_batch], names, self.device)
        return packed

    def _nucleus(self, batch: TrainBatch, micro_batch: list[int]) -> Nucleus | None:
        """The engine's kept top-p sets of the micro-batch's response positions (``--rollout-top-p`` ≠ 1)."""
        if self.args.rollout_top_p == 1.0 or not micro_batch:
            return None
        all_ids, all_offsets = batch.rollout_top_p_token_ids, batch.rollout_top_p_token_offsets
        if all_ids is None or all_offsets is None:
            raise ValueError("--rollout-top-p != 1 needs rollout_top_p_token_ids and rollout_top_p_token_offsets in the "
                             "train data (the engine's nucleus per position; Sample fields of the same names)")
        vocab = int(self.model.get_output_embeddings().weight.shape[0])
        ids, offsets, base = [], [torch.zeros(1, dtype=torch.long)], 0
        for i in micro_batch:
            sample_ids = torch.as_tensor(all_ids[i]).long()
            sample_offsets = torch.as_tensor(all_offsets[i]).long()
            _check_nucleus(batch, i, sample_ids, sample_offsets, vocab)
            ids.append(sample_ids)
            offsets.append(sample_offsets[1:] + base)
            base += sample_ids.numel()
        return Nucleus(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long), torch.cat(offsets), self.device)

    def _outputs(self, model, batch: TrainBatch, micro_batch: list[int], packed, output: ModelOutput) -> ModelOutputs:
        if output.kind == "values":
            return ModelOutputs(values=forward_response_logits(model, packed, self.attn_implementation).float())
        if output.kind == "logits":
            logits = forward_response_logits(model, packed, self.attn_implementation, full=True).float()[None]
            return ModelOutputs(logits=logits, extras={"tokens": packed.input_ids,
                                                       "packed_seq_params": {"cu_seqlens": packed.cu_seqlens}})
        log_probs, entropy = forward_log_probs(model, packed, self.attn_implementation, self.args.rollout_temperature,
                                               self.chunk_rows, self._nucleus(batch, micro_batch),
                                               entropy_grad=output.entropy_grad, exact=self.true_on_policy)
        return ModelOutputs(log_probs=log_probs, entropy=entropy if output.entropy else None)

    @torch.no_grad()
    def forward_only(self, which: str, batch: TrainBatch, output: ModelOutput):
        """Per-sample log-probs (and entropy), or values, over the same micro-batches as training
        (so the first step's recomputed π_old equals the training forward bit for bit)."""
        model = self._models()[which]
        parked = which != "model" and self.device.type == "cuda"
        if parked:
            model.to(self.device)
        try:
            return self._forward_only(model, batch, output, which)
        finally:
            if parked:
                self._park(model)

    def _routing(self, batch: TrainBatch, micro_batch: list[int], packed, forward_only: bool):
        """The routing replay around one micro-batch of the actor: R3 replays the engine's experts in
        the π_old pass and in training; R2 records them in the π_old pass and replays them in training."""
        if self.routing is None or packed.dummy:
            return contextlib.nullcontext()
        names = [f"sample {batch.sample_indices[i] if batch.sample_indices is not None else i}" for i in micro_batch]
        if self.args.use_rollout_routing_replay:
            routed = batch.rollout_routed_experts
            missing = [name for i, name in zip(micro_batch, names) if routed is None or routed[i] is None]
            if missing:
                raise ValueError(f"--use-rollout-routing-replay needs rollout_routed_experts for every sample; {missing[0]} "
                                 "has none (the engine returns them with return_routed_experts on a server started "
                                 "with --enable-return-routed-experts)")
            return self.routing.replay(packed, [routed[i] for i in micro_batch], names)
        if forward_only:
            return self.routing.record(packed, micro_batch)
        missing = [name for i, name in zip(micro_batch, names) if i not in self.routing.recorded]
        if missing:
            raise RuntimeError(f"--use-routing-replay replays the routing recorded in the π_old forward pass, and none "
                               f"was recorded for {missing[0]} (with --use-rollout-logprobs there is no such pass: use "
                               "--use-rollout-routing-replay)")
        return self.routing.replay(packed, [self.routing.recorded[i] for i in micro_batch], names)

    def finish_rollout_step(self) -> None:
        if self.routing is not None:
            self.routing.finish()

    def _forward_only(self, model, batch: TrainBatch, output: ModelOutput, which: str = "model"):
        n = len(batch.tokens)
        out: list = [torch.zeros(0)] * n
        entropy_out: list = [torch.zeros(0)] * n
        for micro_batch in batch.schedule.micro_batch_indices:
            if not micro_batch:
                continue
            packed = self._pack(batch, micro_batch, output)
            if packed.predict_positions.numel() == 0:
                continue
            routing = self._routing(batch, micro_batch, packed, forward_only=True) if which == "model" else None
            with routing or contextlib.nullcontext():
                result = self._outputs(model, batch, micro_batch, packed, output)
            per_token = result.values if output.kind == "values" else result.log_probs
            # one device-to-host copy per micro-batch, split on the host
            for j, piece in zip(micro_batch, torch.split(per_token.detach().float().cpu(), packed.response_lengths)):
                out[j] = piece
            if output.entropy:
                for j, piece in zip(micro_batch, torch.split(result.entropy.detach().float().cpu(), packed.response_lengths)):
                    entropy_out[j] = piece
        _reshard(model)
        return out, (entropy_out if output.entropy else None)

    def forward_backward(self, batch: TrainBatch, micro_batches: list[list[int]], output: ModelOutput, loss_fn):
        """Forward + backward of each micro-batch. The loss is ``loss_fn``'s × dp: FSDP averages
        gradients over the dp ranks, so the accumulated gradient is that of Σ loss_fn."""
        results = []
        for index, micro_batch in enumerate(micro_batches):
            if self.world_size == 1:
                # one rank has nothing to reduce: gradients accumulate in place, and FSDP's copy into
                # the sharded gradient runs once per step instead of once per micro-batch
                self.model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            packed = self._pack(batch, micro_batch, output)
            if packed.predict_positions.numel() == 0:
                # every rank runs the same FSDP collectives, with or without tokens: a zero loss through every parameter
                zero = forward_response_logits(self.model, packed, self.attn_implementation).float().sum() * 0.0
                zero.backward()
                continue
            with self._routing(batch, micro_batch, packed, forward_only=False):  # backward too: recomputed layers
                loss, metrics = loss_fn(micro_batch, self._outputs(self.model, batch, micro_batch, packed, output))
                (loss * self.world_size).backward()
            results.append(metrics)
        return results

    # ------------------------------------------------------------------ optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> tuple[float, list[float]]:
        self.await_optimizer_state()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=self.args.clip_grad)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lrs = self.scheduler.get_last_lr()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), list(lrs)

    def reset_optimizer_state(self) -> None:
        self.optimizer.state.clear()

    def copy_weights(self, source: str, target: str) -> None:
        _copy_weights(self._models()[source], self._models()[target])

    # ------------------------------------------------------------------ checkpoints and weights

    def save(self, rollout_id: int) -> None:
        """DCP checkpoint (model, optimizer, scheduler, RNG, step) under ``--save`` (critic: ``<save>/critic``);
        with ``--async-save`` written in the background (``wait_for_save``)."""
        self.await_optimizer_state()
        if self.args.async_save:
            if self._async_writer is None:
                self._async_writer = ckpt.AsyncCheckpointWriter()
            self._async_writer.save(self, self._checkpoint_dir(self.args.save), rollout_id)
        else:
            ckpt.save_checkpoint(self, self._checkpoint_dir(self.args.save), rollout_id)

    def wait_for_save(self) -> None:
        if self._async_writer is not None:
            self._async_writer.wait()

    def save_hf(self, path: str) -> None:
        ckpt.save_hf(self, path)

    def named_hf_weights(self, dtype: torch.dtype | None):
        return ckpt.named_hf_weights(self, dtype)

    # ------------------------------------------------------------------ colocation

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (no-op on a CPU device).
        Finishes an offload :meth:`begin_offload` started."""
        if self.device.type != "cuda":
            self.offloaded = True
            return
        _reshard(self.model)
        self.await_optimizer_state()  # an onload's state copies still in flight
        if self._state_out is None:
            self.begin_offload()
        # non_blocking: a copy to the host lands in pinned memory (torch keeps the freed pinned blocks for the
        # next offload), so both directions run at pinned-copy bandwidth; pageable copies of a 1.7B model's
        # parameters and Adam state took seconds each way on the H200
        self.model.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        self._state_out = None  # the device copies the host copies were read from: free now
        torch.cuda.empty_cache()
        self.offloaded = True

    def begin_offload(self) -> None:
        """Start copying the optimizer state (2/3 of the trainer's bytes with Adam) to host memory on a side
        stream and return: the weight push, which reads only the parameters, runs meanwhile. :meth:`offload`
        finishes (parameters, then one synchronize)."""
        if self.device.type != "cuda" or self._state_out is not None:
            return
        self.await_optimizer_state()
        # the device tensors stay referenced: the copy reads them until the synchronize in offload()
        self._state_out = self._move_optimizer_state(torch.device("cpu"))

    def onload(self) -> None:
        """Parameters back to the device now; the optimizer state on a side stream, awaited before the
        optimizer step: its copy overlaps the step's forward and backward passes."""
        if self.device.type != "cuda":
            self.offloaded = False
            return
        self.model.to(self.device, non_blocking=True)
        self._move_optimizer_state(self.device)
        self._state_in = self._stream.record_event()
        torch.cuda.current_stream().synchronize()  # the parameters (the state keeps copying)
        self.offloaded = False

    def _move_optimizer_state(self, device: torch.device) -> list[torch.Tensor]:
        """Queue the optimizer state's copies to ``device`` on the side stream (after what the current stream has
        queued: the optimizer step that wrote them) and put the copies in its place; returns the tensors copied from."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream())
        moved = []
        with torch.cuda.stream(self._stream):
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step" and value.device.type != device.type:
                        moved.append(value)
                        state[key] = value.to(device, non_blocking=True)
        return moved

    def await_optimizer_state(self) -> None:
        """The optimizer state's copy to the device (started by onload) before anything reads it."""
        if self._state_in is not None:
            torch.cuda.current_stream().wait_event(self._state_in)
            self._state_in = None


def _check_nucleus(batch: TrainBatch, i: int, ids: torch.Tensor, offsets: torch.Tensor, vocab: int) -> None:
    response = int(batch.response_lengths[i])
    name = f"sample {batch.sample_indices[i]}" if batch.sample_indices is not None else f"sample {i}"
    if (offsets.numel() != response + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel()
            or bool((offsets.diff() < 0).any())):
        raise ValueError(f"{name}: rollout_top_p_token_offsets must have response_length + 1 = {response + 1} "
                         f"non-decreasing entries from 0 to the id count {ids.numel()}, got "
                         f"{offsets.tolist()[:8]}{'...' if offsets.numel() > 8 else ''} ({offsets.numel()} entries)")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name}: rollout_top_p_token_ids outside the vocabulary [0, {vocab})")


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
        "--opd-type megatron (teacher model inside the trainer)": args.use_opd
        and args.opd_type == "megatron",
        "--use-routing-replay / --use-rollout-routing-replay with --keep-old-actor (the routing is recorded and "
        "replayed on the actor)": args.use_routing_replay and args.keep_old_actor,
        "--use-routing-replay / --use-rollout-routing-replay with --fsdp-compile (the router hooks)":
        args.use_routing_replay and args.fsdp_compile,
        "--enable-mtp-training": args.enable_mtp_training,
    }
    names = [name for name, active in unsupported.items() if active]
    if names:
        raise NotImplementedError(f"--train-backend fsdp does not support {', '.join(names)} yet")

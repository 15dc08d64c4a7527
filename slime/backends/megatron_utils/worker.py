"""The Megatron-Core training worker: one per rank, hosted by ``slime.ray.train_actor.TrainRayActor``.

It keeps the FSDP worker's train-data contract and algorithm flow (forward-only passes, KL,
advantages, the shared loss math of :mod:`slime.utils.ppo_utils`, metrics) by subclassing
:class:`~slime.backends.fsdp_utils.worker.FSDPTrainWorker` and replacing what is Megatron-specific:

* model: ``GPTModel`` from :func:`~slime.backends.megatron_utils.model.model_provider` (or
  ``--custom-model-provider-path``), wrapped in Megatron's ``DistributedDataParallel``; weights from
  an HF directory or a torch_dist checkpoint (:mod:`~slime.backends.megatron_utils.checkpoint`);
* forward: fp32 parameters, bf16 autocast; micro-batches packed (thd: Transformer Engine's
  attention, or varlen flash attention in the local spec; right-padded where neither runs:
  :func:`~slime.backends.megatron_utils.model.packs_micro_batches`),
  run through Megatron's pipeline schedule (:mod:`~slime.backends.megatron_utils.pipeline`) for
  the forward-only passes and for training, at any pipeline size;
* optimizer: Megatron's distributed optimizer (``--optimizer-cpu-offload`` passed through) and
  ``OptimizerParamScheduler``; gradient clipping inside ``optimizer.step()``;
* hooks: ``--custom-megatron-init-path`` after set-up, the before-log-prob hook before every
  forward-only pass, the before-train-step hook before every optimizer step (INTERFACES §2.19);
* ``--megatron-config-path``: a YAML with ``actor:`` / ``critic:`` sections of flag overrides
  (argparse names) applied to this role's copy of ``args``;
* offload/onload for colocation: parameters, gradient buffers and optimizer state copied to host
  memory and their device storage freed, restored in place (``torch_memory_saver`` is not used yet);
* the PPO critic (``role="critic"``): the same model with a value head as its output layer;
* MoE routing replay (``--use-routing-replay``, ``--use-rollout-routing-replay``):
  :mod:`~slime.backends.megatron_utils.routing_replay`.

Parallelism supported by this worker: data, tensor, pipeline (non-interleaved 1F1B), expert and
context parallel. The ranks of one model-parallel group (TP × PP, and its CP peers) compute one model
together, so the rollout shards of the group are merged and all of them train on the union
(:mod:`~slime.backends.megatron_utils.data`); the last stage's log-probs are broadcast to the
other stages, so every rank of the group holds the same rollout data. Context parallelism:
:mod:`~slime.backends.megatron_utils.context_parallel` (packed CP chunks, K/V all-gathered, the
response-row values gathered back so every CP rank computes the same loss). Refused with an explicit
error: virtual pipeline stages, ``--rollout-top-p`` < 1 (no nucleus renormalisation here),
``--keep-old-actor``, and CP together with a custom loss, routing replay or sequence parallelism.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Iterator

import torch
import torch.distributed as dist

from slime.backends.fsdp_utils.worker import FSDPTrainWorker
from slime.backends.megatron_utils import checkpoint as ckpt
from slime.backends.megatron_utils import forward as fw
from slime.backends.megatron_utils import model as mm
from slime.backends.megatron_utils import weight_mapping as wm
from slime.backends.megatron_utils.logprobs import log_probs_and_entropy
from slime.backends.megatron_utils.model_config import fill_model_args, hf_validate_args, load_hf_config
from slime.backends.megatron_utils.offload import offload_to_host, onload_from_host
from slime.utils import ppo_utils
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

__all__ = ["MegatronTrainWorker", "apply_megatron_config"]

#: Megatron-Core needs CUDA; the CPU tests run it on gloo with its few CUDA-only calls redirected
#: (tests/backends/megatron_utils/megatron_cpu.py) and set this variable to let the worker start.
CPU_TESTING_ENV = "SLIME_MEGATRON_CPU_TESTING"


def apply_megatron_config(args, role: str):
    """``--megatron-config-path`` YAML: ``{actor: {flag: value}, critic: {...}}`` (argparse names,
    dashes or underscores) applied to a copy of ``args`` for ``role``; unknown flags are errors."""
    path = getattr(args, "megatron_config_path", None)
    if not path:
        return args
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict) or not set(config) <= {"actor", "critic"}:
        raise ValueError(f"--megatron-config-path {path}: expected a mapping with 'actor' and/or 'critic' sections, got {list(config) if isinstance(config, dict) else type(config).__name__}")
    args = copy.copy(args)
    for key, value in (config.get(role) or {}).items():
        dest = key.lstrip("-").replace("-", "_")
        if not hasattr(args, dest):
            raise ValueError(f"--megatron-config-path {path}: {role}.{key} is not a flag")
        setattr(args, dest, value)
    return args


class MegatronTrainWorker(FSDPTrainWorker):
    """One rank of the Megatron actor (``role="actor"``) or PPO critic (``role="critic"``: the same
    GPTModel with a :class:`~slime.backends.megatron_utils.model.ValueHead` as its output layer,
    never tied to the embeddings; checkpoints under ``<save>/critic``)."""

    def __init__(self, args, role: str = "actor"):
        if role not in ("actor", "critic"):
            raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")
        args = copy.copy(apply_megatron_config(args, role))
        cp = args.context_parallel_size > 1
        refused = {
            "--context-parallel-size > 1 with --loss-type custom_loss (the custom loss reads every position's logits; "
            "under CP each rank holds a part of each sample)": cp and args.loss_type == "custom_loss",
            "--context-parallel-size > 1 with MoE routing replay (the replayed experts are laid out per sample, not per "
            "CP chunk)": cp and (getattr(args, "use_routing_replay", False) or getattr(args, "use_rollout_routing_replay", False)),
            "--context-parallel-size > 1 with --sequence-parallel (not combined yet; CP runs on the local layer spec)":
                cp and getattr(args, "sequence_parallel", False) and args.tensor_model_parallel_size > 1,
            f"--virtual-pipeline-model-parallel-size {getattr(args, 'virtual_pipeline_model_parallel_size', None)} "
            f"(the trainer builds one model chunk per stage)": (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1,
            f"--rollout-top-p {getattr(args, 'rollout_top_p', 1.0)} (log-probs renormalised over the engine's nucleus: "
            f"--train-backend fsdp only)": getattr(args, "rollout_top_p", 1.0) != 1.0,
            "--keep-old-actor (--train-backend fsdp only)": getattr(args, "keep_old_actor", False),
            "--sequence-parallel without Transformer Engine or Apex (Megatron-Core's local layer spec then norms "
            "with torch modules that do not support it; drop --sequence-parallel or install transformer_engine)":
                getattr(args, "sequence_parallel", False) and args.tensor_model_parallel_size > 1 and not mm.have_sequence_parallel_norm(),
        }
        names = [name for name, active in refused.items() if active]
        if names:
            raise NotImplementedError(f"--train-backend megatron does not support {'; '.join(names)}")
        if not torch.cuda.is_available() and os.environ.get(CPU_TESTING_ENV) != "1":
            raise RuntimeError("--train-backend megatron needs CUDA GPUs; on CPU use --train-backend fsdp")
        # the FSDP backend refuses routing replay; this one replays routing itself (routing_replay.py)
        fsdp_view = copy.copy(args)
        fsdp_view.use_routing_replay = False
        super().__init__(fsdp_view, role)
        self.args = args
        self.routing = None  # RoutingReplay of the actor model with --use-routing-replay
        self._routed = None  # this rollout step's rollout_routed_experts (R3)
        self._merged = False  # inside a call whose data is already the model-parallel group's merged shards
        self.attn_implementation = "megatron"
        self.ddp_model = None
        self.layout: wm.ModelLayout | None = None
        self._host_copies: dict = {}
        self.packed = False  # micro-batches packed (thd) rather than right-padded: set by init from the model
        self._samples_group = None  # the ranks holding the same samples (_build_same_samples_group), set by init

    # ------------------------------------------------------------------ set-up

    def _init_parallel_state(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        args = self.args
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                context_parallel_size=args.context_parallel_size,
                expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size or 1,
                distributed_timeout_minutes=args.distributed_timeout_minutes,
            )
        if torch.cuda.is_available():
            model_parallel_cuda_manual_seed(args.seed)
        self._samples_group = self._build_same_samples_group()

    def _build_model(self, trainable: bool):
        from megatron.core import parallel_state as ps

        args = self.args
        path = getattr(args, "custom_model_provider_path", None)
        pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        if path:
            provider = load_function(path)
            model = provider(pre_process=pre, post_process=post)
        else:
            model = mm.model_provider(args, pre_process=pre, post_process=post)
        if self.role == "critic":
            mm.attach_value_head(model, self._weights_dir(), args.seed)
        model.to(self.device)
        if not trainable:
            model.requires_grad_(False)
            return model.eval()
        from slime.backends.fsdp_utils.worker import _apply_freeze_lists

        _apply_freeze_lists(model, args)
        return model

    def _wrap_ddp(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
            bucket_size=None, average_in_collective=False,
        )
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        args = self.args
        lr = self._lr()
        config = OptimizerConfig(
            optimizer=args.optimizer, lr=lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
            use_distributed_optimizer=True, params_dtype=torch.float32, bf16=False,
            optimizer_cpu_offload=args.optimizer_cpu_offload,
            overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
            use_precision_aware_optimizer=args.use_precision_aware_optimizer,
        )
        optimizer = get_megatron_optimizer(config, [self.ddp_model])
        steps_per_rollout = max(args.rollout_batch_size * args.n_samples_per_prompt // max(args.global_batch_size, 1), 1)
        total = (getattr(args, "num_rollout", None) or 1) * steps_per_rollout
        warmup = args.lr_warmup_iters if not args.lr_warmup_fraction else int(args.lr_warmup_fraction * total)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=args.lr_warmup_init, max_lr=lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=args.lr_decay_iters or total, lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=total, wd_incr_style="constant",
        )
        return optimizer, scheduler

    def _load_weights(self, model, load: str | None, ckpt_step: int | None, finetune: bool,
                      optimizer=None, scheduler=None) -> int | None:
        """Weights (and, when resuming, optimizer/scheduler/RNG); returns the resumed iteration."""
        args = self.args
        choice = ckpt.resolve_checkpoint(load, ckpt_step, finetune)
        if choice.kind == "none":
            choice = ckpt.CheckpointChoice("hf", self._weights_dir())
        if choice.kind == "hf":  # the critic's value head came with the model (attach_value_head)
            mm.load_hf_weights(model, choice.path, self.layout, skip_prefixes=self._head_prefixes())
            return None
        extra = ckpt.load_checkpoint(choice, model, optimizer if choice.resume and not args.no_load_optim else None,
                                     scheduler, load_rng=not args.no_load_rng)
        if extra:
            self.global_step = int(extra.get("global_step", 0))
        return choice.iteration if choice.resume else None

    def _weights_dir(self) -> str:
        """The HF directory this role starts from (the critic: ``--critic-hf-checkpoint`` when set)."""
        if self.role == "critic":
            return getattr(self.args, "critic_hf_checkpoint", None) or self.args.hf_checkpoint
        return self.args.hf_checkpoint

    def _head_prefixes(self) -> tuple[str, ...]:
        return ("output_layer.",) if self.role == "critic" else ()

    def _lr(self) -> float:
        return self.args.lr if self.role == "actor" else (getattr(self.args, "critic_lr", None) or self.args.lr)

    def init(self) -> int | None:
        args = self.args
        if getattr(args, "hf_checkpoint", None) is None:
            raise ValueError("--train-backend megatron needs --hf-checkpoint (config, tokenizer, and the HF weight names)")
        self._init_parallel_state()
        hf_config = load_hf_config(args.hf_checkpoint)
        filled = fill_model_args(args, hf_config)
        if filled:
            logger.info("no model preset given: shape flags from %s/config.json", args.hf_checkpoint)
        hf_validate_args(args, hf_config)
        if self.role == "critic":
            args.untie_embeddings_and_output_weights = True  # the value head replaces the output layer
        if getattr(args, "padded_vocab_size", None) is None:
            args.padded_vocab_size = wm.padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                          args.tensor_model_parallel_size)
        self.hf_config = hf_config
        self.layout = mm.layout_for(args, hf_config)
        if self.layout.num_experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
            raise ValueError(
                f"--tensor-model-parallel-size {args.tensor_model_parallel_size} on an MoE model ({args.hf_checkpoint}) "
                "needs --sequence-parallel (Megatron-Core requires it for MoE training"
                + ("" if mm.have_sequence_parallel_norm() else ", and it needs Transformer Engine or Apex")
                + "); or split the experts with --expert-model-parallel-size and keep TP at 1")
        model = self._build_model(trainable=True)
        self.packed = fw.packs_micro_batches(model, self.device)
        if args.context_parallel_size > 1:
            from slime.backends.megatron_utils.packed_attention import supports_packing

            if not supports_packing(mm.unwrap(model)):
                raise ValueError(f"--context-parallel-size {args.context_parallel_size} needs the attention of "
                                 "slime.backends.megatron_utils.model.model_provider (PackedCoreAttention, RoPE); "
                                 "--custom-model-provider-path gave a model without it")
            self.packed = True  # CP chunks are packed rows (exact attention where flash attention does not run)
        if getattr(args, "use_routing_replay", False):
            if not self.layout.num_experts:
                raise ValueError("--use-routing-replay / --use-rollout-routing-replay need an MoE model; "
                                 f"{args.hf_checkpoint} has no experts")
            from slime.backends.megatron_utils.routing_replay import RoutingReplay

            self.routing = RoutingReplay(model)
        self.ddp_model = self._wrap_ddp(model)
        self.model = self.ddp_model
        self.optimizer, self.scheduler = self._build_optimizer()
        start_iteration = self._load_weights(model, self._checkpoint_dir(args.load), args.ckpt_step, args.finetune,
                                             self.optimizer, self.scheduler)
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()  # main params of the distributed optimizer follow the loaded weights
        if self.role == "actor" and (args.use_kl_loss or args.kl_coef != 0):
            self.ref_model = self._build_model(trainable=False)
            ref = args.ref_load or args.hf_checkpoint
            self._load_weights(self.ref_model, ref, getattr(args, "ref_ckpt_step", None), True)
            self._park_ref()
        hook = getattr(args, "custom_megatron_init_path", None)
        if hook:
            load_function(hook)(args)
        dist.barrier()
        return None if start_iteration is None else start_iteration + 1

    # ------------------------------------------------------------------ forward passes

    def _inputs(self, rollout_data: dict, micro_batch: list[int], full: bool = False) -> fw.MicroBatchInputs:
        """One micro-batch laid out for the model; ``full``: every position (custom loss), not only
        the response."""
        from megatron.core import parallel_state as ps

        tokens = [rollout_data["tokens"][i] for i in micro_batch]
        responses = [int(t.numel()) - 1 for t in tokens] if full else [int(rollout_data["response_lengths"][i]) for i in micro_batch]
        pad = self._tp_size() if self.args.sequence_parallel else 1
        return fw.micro_batch_inputs(tokens, responses, self.device, packed=self.packed, pad_multiple=pad,
                                     sample_indices=micro_batch, cp_size=ps.get_context_parallel_world_size(),
                                     cp_rank=ps.get_context_parallel_rank())

    @torch.no_grad()
    def _forward_only(self, model, rollout_data: dict, with_entropy: bool = False, values: bool = False):
        """Per-sample log-probs (and entropy), or the critic's values, over the training
        micro-batches, through the pipeline schedule; every stage receives the last stage's results."""
        from slime.backends.megatron_utils import pipeline

        hook = getattr(self.args, "custom_megatron_before_log_prob_hook_path", None)
        if hook and not values:
            load_function(hook)(self.args, model, "ref_" if model is self.ref_model else "")
        temperature = self.args.rollout_temperature
        batches = [self._inputs(rollout_data, mb) for mb in self._micro_batches(rollout_data) if mb]

        def collect(inputs: fw.MicroBatchInputs, logits: torch.Tensor):
            zero = torch.zeros((), device=logits.device)
            if values:  # the value head's one column: V at the positions predicting response tokens
                return zero, (inputs.gather(logits[:, 0].float()).cpu(), None)
            log_probs, entropy = log_probs_and_entropy(logits, inputs.targets, temperature, with_entropy=with_entropy,
                                                       entropy_grad=False)
            if entropy is None:
                return zero, (inputs.gather(log_probs).cpu(), None)
            both = inputs.gather(torch.stack([log_probs, entropy], dim=1)).T.cpu()  # one device-to-host copy
            return zero, (both[0], both[1])

        around = None
        if self.routing is not None and model is self.model:  # π_old: R2 records the routing, R3 replays the engine's
            around = self._replay_rollout_routing if self.args.use_rollout_routing_replay else self.routing.record
        model.eval()
        payloads = pipeline.forward_backward(model, batches, collect, forward_only=True, vocab_size=self._output_width(),
                                             autocast_dtype=self._autocast_dtype(), around_forward=around)
        payloads = pipeline.broadcast_from_last_stage(payloads)
        if model is self.model:
            model.train()
        n = len(rollout_data["tokens"])
        out: list = [torch.zeros(0)] * n
        entropy_out: list = [torch.zeros(0)] * n
        for inputs, (log_probs, entropy) in zip(batches, payloads):
            for j, piece in zip(inputs.sample_indices, torch.split(log_probs, inputs.response_lengths)):
                out[j] = piece.float()
            if entropy is not None:
                for j, piece in zip(inputs.sample_indices, torch.split(entropy, inputs.response_lengths)):
                    entropy_out[j] = piece.float()
        return out, (entropy_out if with_entropy else None)

    def _park_ref(self) -> None:
        if self.ref_model is not None:
            self.ref_model.to("cpu")

    def compute_log_probs(self, rollout_data: dict, **kwargs) -> dict[str, list[torch.Tensor]]:
        """π_old / reference log-probs and KL. Called by the loop on this rank's own shard (PPO), or
        from ``train`` on the model-parallel group's merged data; either way the answer is for the
        samples it was given."""
        if not self._merged:
            return self._on_merged_shards(rollout_data, lambda merged: self.compute_log_probs(merged, **kwargs))
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        try:
            return super().compute_log_probs(rollout_data, **kwargs)
        finally:
            self._park_ref()

    def compute_values(self, rollout_data: dict) -> list[torch.Tensor]:
        if not self._merged:
            return self._on_merged_shards(rollout_data, self.compute_values)
        return super().compute_values(rollout_data)

    def _on_merged_shards(self, rollout_data: dict, compute):
        """``compute`` over the model-parallel group's merged shards (its ranks must run the same
        samples), then this rank's own samples of the per-sample result (a list, or a dict of lists)."""
        merged, own = self._merge_model_parallel_shards(rollout_data, with_own_slice=True)
        self._merged = True
        try:
            result = compute(merged)
        finally:
            self._merged = False
        if isinstance(result, dict):
            return {key: value[own] if isinstance(value, list) else value for key, value in result.items()}
        return result[own]

    def skips_old_log_prob_pass(self, rollout_data: dict) -> bool:
        # the Megatron loss reads π_old from rollout_data["log_probs"]: the forward-only pass always runs
        return False

    # ------------------------------------------------------------------ training

    def _output_width(self) -> int:
        """Columns of the last stage's output that mean something: the vocabulary (padding cut), or
        the critic's single value."""
        return 1 if self.role == "critic" else self.layout.vocab_size

    def _autocast_dtype(self) -> torch.dtype | None:
        # fp32 parameters, bf16 matmuls (DEVICE.md); the CPU tests stay in fp32
        return torch.bfloat16 if self.device.type == "cuda" else None

    def _tp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size()

    def _mp_size(self) -> int:
        """Ranks that hold the same samples: one model-parallel group (TP × PP) and its context-parallel peers."""
        from megatron.core import parallel_state as ps

        return (ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
                * ps.get_context_parallel_world_size())

    def _build_same_samples_group(self):
        """The process group of the :meth:`_mp_size` ranks that hold the same samples: Megatron's
        model-parallel group, or with CP > 1 a group of the ranks with this data-parallel rank (built
        here, at set-up: every rank creates every group, in the same order)."""
        from megatron.core import parallel_state as ps

        if ps.get_context_parallel_world_size() == 1:
            return ps.get_model_parallel_group()
        dp_ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(dp_ranks, ps.get_data_parallel_rank())
        own = None
        for dp_rank in sorted(set(dp_ranks)):
            group = dist.new_group([r for r, d in enumerate(dp_ranks) if d == dp_rank])
            if dp_rank == ps.get_data_parallel_rank():
                own = group
        return own

    def _merge_model_parallel_shards(self, rollout_data: dict, with_own_slice: bool = False):
        """The ranks of a model-parallel group received different shards from the rollout manager;
        all of them compute on their union. ``with_own_slice``: also the slice of the merged
        samples that are this rank's own."""
        from megatron.core import parallel_state as ps

        from slime.backends.megatron_utils.data import merge_shards

        if self._mp_size() == 1:
            return (rollout_data, slice(None)) if with_own_slice else rollout_data
        group = self._samples_group
        shards: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(shards, rollout_data, group=group)
        merged = merge_shards(shards, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        if not with_own_slice:
            return merged
        me = dist.get_rank(group)
        start = sum(len(shard["tokens"]) for shard in shards[:me])
        return merged, slice(start, start + len(rollout_data["tokens"]))

    def train(self, rollout_id: int, rollout_data: dict) -> dict[str, float]:
        merged = self._merge_model_parallel_shards(rollout_data)
        self._routed = merged.get("rollout_routed_experts")
        self._merged = True
        try:
            return super().train(rollout_id, merged)
        finally:
            self._merged = False
            self._routed = None
            if self.routing is not None:
                self.routing.finish()

    def _replay_rollout_routing(self, inputs: fw.MicroBatchInputs):
        """R3: replay the engine's expert choices for this micro-batch."""
        from megatron.core import parallel_state as ps

        from slime.backends.megatron_utils.routing_replay import rollout_targets

        routed = getattr(self, "_routed", None)
        if routed is None or any(routed[i] is None for i in inputs.sample_indices):
            raise ValueError("--use-rollout-routing-replay needs rollout_routed_experts for every sample (the engine "
                             "returns them with return_routed_experts; the embedded engine does not)")
        sp = self.args.sequence_parallel and self._tp_size() > 1
        targets = rollout_targets(inputs, [routed[i] for i in inputs.sample_indices], self.routing.layers,
                                  self.args.moe_router_topk, self.device,
                                  ps.get_tensor_model_parallel_rank() if sp else 0, self._tp_size() if sp else 1)
        return self.routing.replay(targets)

    def _all_reduce_sums(self, sums: dict[str, torch.Tensor], normaliser: float) -> dict[str, float]:
        # the loss sums exist on the last pipeline stage only, where the TP and CP peers hold the same ones
        from megatron.core import parallel_state as ps

        peers = self._tp_size() * ps.get_context_parallel_world_size()
        return {k: v / peers for k, v in super()._all_reduce_sums(sums, normaliser).items()}

    def _loss(self, rollout_data: dict, inputs: fw.MicroBatchInputs, logits: torch.Tensor):
        """(S-reduced loss, metric sums) of one micro-batch from its response logits ``[K, V]`` (in
        the autocast dtype) — the same algorithm calls as the FSDP backend; log-probs and entropy
        through :func:`~slime.backends.megatron_utils.logprobs.log_probs_and_entropy` (fused Triton
        kernels on CUDA)."""
        args = self.args
        batch = self._micro_batch_fields(rollout_data, inputs.sample_indices)
        reducer = ppo_utils.make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"], batch["rollout_mask_sums"],
                                                    args.calculate_per_token_loss)
        if self.role == "critic":
            return ppo_utils.value_loss_function(args, batch, inputs.gather(logits[:, 0].float()), reducer)
        if args.loss_type == "custom_loss":
            return load_function(args.custom_loss_function_path)(args, batch, logits.float()[None], reducer)
        log_probs, entropy = log_probs_and_entropy(logits, inputs.targets, args.rollout_temperature,
                                                   entropy_grad=args.entropy_coef != 0)
        # under context parallelism: every CP rank gets the whole micro-batch's values and computes the same loss
        log_probs, entropy = inputs.gather(log_probs), inputs.gather(entropy)
        if args.loss_type == "sft_loss":
            return ppo_utils.sft_loss_function(args, batch, log_probs, reducer)
        return ppo_utils.policy_loss_function(args, batch, log_probs, entropy, reducer, self._pg_reducer(batch),
                                              self._tis_function())

    def forward_backward(self, rollout_data: dict, step_id: int):
        """Accumulate the gradients of optimizer step ``step_id`` through the pipeline schedule;
        returns (metric sums of this rank, tokens, flops). Each micro-batch's loss is
        S(ℓ)·dp/normaliser because Megatron's DDP averages gradients over the data-parallel ranks,
        so the reduced gradient is that of Σ S / normaliser (§5.8)."""
        from megatron.core import parallel_state as ps

        from slime.backends.megatron_utils import pipeline

        counts = rollout_data["num_microbatches"]
        first = sum(counts[:step_id])
        normaliser = self.step_normaliser(rollout_data, step_id)
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        full = self.args.loss_type == "custom_loss" and self.role == "actor"
        # a rank without samples in this step still joins the gradient reduction (finalize_model_grads)
        batches = [self._inputs(rollout_data, mb, full) for mb in self._micro_batches(rollout_data)[first: first + counts[step_id]] if mb]

        def loss_fn(inputs: fw.MicroBatchInputs, logits: torch.Tensor):
            loss, metrics = self._loss(rollout_data, inputs, logits)
            return loss * dp / normaliser, {k: v.detach().double().cpu() for k, v in metrics.items()}

        around = None
        if self.routing is not None:
            self.routing.start_step()
            around = self._replay_rollout_routing if self.args.use_rollout_routing_replay else \
                (lambda inputs: self.routing.replay(self.routing.recorded_targets(inputs)))
        payloads = pipeline.forward_backward(self.model, batches, loss_fn, forward_only=False,
                                             vocab_size=self._output_width(), autocast_dtype=self._autocast_dtype(),
                                             around_forward=around)
        sums: dict[str, torch.Tensor] = {}
        for metrics in payloads:
            for key, value in metrics.items():
                sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + value
        tokens = sum(sum(b.lengths) for b in batches)
        flops = sum(self._flops(b.lengths, int(b.targets.numel())) for b in batches)
        return sums, tokens, flops

    def _train_steps(self, rollout_id: int, rollout_data: dict) -> dict[str, float]:
        import time

        from megatron.core.distributed import finalize_model_grads

        args = self.args
        tag = "" if self.role == "actor" else "critic-"  # §5.5: critic metrics carry the role tag
        hook = getattr(args, "custom_megatron_before_train_step_hook_path", None)
        hook = load_function(hook) if hook else None
        start, tokens_done, flops_done = time.perf_counter(), 0, 0.0
        step_results = []
        self.model.train()
        for step_id in range(len(rollout_data["num_microbatches"])):
            if hook is not None:
                hook(args, rollout_id, step_id, self.model, self.optimizer, self.scheduler)
            self.ddp_model.zero_grad_buffer()
            self.optimizer.zero_grad()
            sums, tokens, flops = self.forward_backward(rollout_data, step_id)
            tokens_done, flops_done = tokens_done + tokens, flops_done + flops
            finalize_model_grads([self.ddp_model])  # DP reduce (+ sequence-parallel norm grads)
            succeeded, grad_norm, _ = self.optimizer.step()
            if not succeeded:
                raise RuntimeError(f"optimizer step {step_id} of rollout {rollout_id} failed (non-finite gradients)")
            self.scheduler.step(increment=1)
            reduced = self._all_reduce_sums(sums, self.step_normaliser(rollout_data, step_id))
            metrics = {f"train/{tag}{k}": v for k, v in reduced.items()}
            metrics[f"train/{tag}grad_norm"] = float(grad_norm or 0.0)
            for k, group in enumerate(self.optimizer.param_groups):
                metrics[f"train/{tag}lr-pg_{k}"] = float(group["lr"])
            metrics["train/step"] = float(self.global_step)
            self.global_step += 1
            step_results.append(metrics)
        self.step_metrics = step_results
        elapsed = time.perf_counter() - start
        totals = torch.tensor([tokens_done, flops_done], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        totals /= self._mp_size()  # the ranks of a model-parallel group process the same tokens together
        out = {k: sum(s[k] for s in step_results) / len(step_results) for k in step_results[0] if k != "train/step"}
        out[f"perf/{self.role}_train_time"] = elapsed
        out[f"perf/{self.role}_train_tok_per_s"] = float(totals[0]) / elapsed
        out[f"perf/{self.role}_train_tflops"] = float(totals[1]) / elapsed / self.world_size / 1e12
        return out

    def _flops(self, lengths: list[int], num_predicted: int) -> float:
        """Same estimate as the FSDP backend (6·N_body per token, LM head per predicted token,
        causal attention), from the HF config."""
        c = self.hf_config
        hidden, layers = c["hidden_size"], c["num_hidden_layers"]
        head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
        attn_dim = c["num_attention_heads"] * head_dim
        kv = c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
        experts = self.layout.num_experts
        ffn = (c.get("moe_intermediate_size", 0) * c.get("num_experts_per_tok", 0) + (c.get("shared_expert_intermediate_size") or 0)) \
            if experts else c["intermediate_size"]
        body = layers * (hidden * (attn_dim + 2 * kv) + attn_dim * hidden + 3 * hidden * ffn)
        head = c["vocab_size"] * hidden
        attention = sum(6.0 * layers * attn_dim * s * s for s in lengths)
        return 6.0 * body * sum(lengths) + 6.0 * head * num_predicted + attention

    def update_ref_model(self) -> None:
        if self.ref_model is None:
            return
        with torch.no_grad():
            ref = dict(mm.unwrap(self.ref_model).named_parameters())
            for name, param in mm.unwrap(self.model).named_parameters():
                ref[name].copy_(param.to(ref[name].device))

    # ------------------------------------------------------------------ checkpoints and weights

    def save(self, rollout_id: int) -> None:
        if not self.args.save:
            raise ValueError("save needs --save (the checkpoint directory)")
        ckpt.save_checkpoint(self._checkpoint_dir(self.args.save), rollout_id, self.ddp_model,
                             None if self.args.no_save_optim else self.optimizer, self.scheduler, self.global_step)

    def save_hf(self, path: str) -> None:
        """HF directory (safetensors + config + tokenizer) written by rank 0; collective. The critic
        adds its value head as ``value_head.safetensors`` (the FSDP critic's file)."""
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer

        from slime.backends.megatron_utils import pipeline

        state = {name: tensor.cpu() for name, tensor in
                 mm.iter_hf_weights(self.model, self.layout, torch.bfloat16, skip_prefixes=self._head_prefixes())}
        head = None
        if self.role == "critic":
            gpt = mm.unwrap(self.model)
            last = {"weight": gpt.output_layer.weight.detach().float().cpu(), "bias": gpt.output_layer.bias.detach().float().cpu()} \
                if getattr(gpt, "post_process", False) else None
            head = pipeline.broadcast_from_last_stage(last)
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            if head is not None:
                save_file(head, os.path.join(path, mm.VALUE_HEAD_FILE))
            AutoConfig.from_pretrained(self.args.hf_checkpoint).save_pretrained(path)
            AutoTokenizer.from_pretrained(self.args.hf_checkpoint).save_pretrained(path)
        dist.barrier()

    def iter_weight_buckets(self, bucket_bytes: int | None = None, dtype: torch.dtype | None = torch.bfloat16
                            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors in buckets (collective; every rank receives every tensor). MoE
        experts carry checkpoint names (SGLang), or transformers' fused 3-D names for the embedded engine."""
        if self.role != "actor":
            raise RuntimeError("iter_weight_buckets is an actor method: engines take the actor's weights, not the critic's")
        limit = bucket_bytes or self.args.update_weight_buffer_size
        bucket, size = [], 0
        named = mm.iter_hf_weights(self.model, self.layout, dtype, param_source=self._offloaded_param_source())
        if self.layout.num_experts and getattr(self.args, "rollout_backend", None) == "embedded":
            # the embedded engine loads by transformers' in-memory names (3-D expert tensors)
            named = wm.fuse_experts_for_transformers(named, self.layout)
        for name, tensor in named:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
        if bucket:
            yield bucket

    # ------------------------------------------------------------------ colocation

    def _offloaded_param_source(self):
        """While offloaded (colocated mode pushes weights after offloading the trainer) the
        parameters' device storage is freed: read each one from its slice of the host copy of its
        buffer instead. With one model-parallel rank the export stays on the host (the transport
        moves one bucket at a time); otherwise each parameter goes to the device for the gathers."""
        if not self.offloaded:
            return None
        from megatron.core import parallel_state as ps

        views = {}
        for i, buffer in enumerate(self.ddp_model.buffers + self.ddp_model.expert_parallel_buffers):
            host = self._host_copies[i]
            for param, (start, _end, _bucket) in buffer.param_index_map.items():
                views[param] = host[start:start + param.numel()].view(param.shape)
        collective = (self._mp_size() > 1 or ps.get_expert_model_parallel_world_size() > 1
                      or ps.get_expert_tensor_parallel_world_size() > 1)
        return (lambda param: views[param].to(self.device)) if collective else views.__getitem__

    def offload(self) -> None:
        """Free the device memory of parameters, gradients and optimizer state (host copies kept)."""
        if not self.offloaded:
            self._host_copies = offload_to_host(self.ddp_model, self.optimizer)
            self.offloaded = True

    def onload(self) -> None:
        if self.offloaded:
            onload_from_host(self.ddp_model, self.optimizer, self._host_copies, self.device)
            self._host_copies = {}
            self.offloaded = False

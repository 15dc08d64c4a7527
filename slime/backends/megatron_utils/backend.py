"""The Megatron-Core training backend: implements :class:`~slime.backends.training.backend.TrainBackend`.

* model: ``GPTModel`` from :func:`~slime.backends.megatron_utils.model.model_provider` (or
  ``--custom-model-provider-path``), wrapped in Megatron's ``DistributedDataParallel``; weights from
  an HF directory or a torch_dist checkpoint (:mod:`~slime.backends.megatron_utils.checkpoint`);
* forward: fp32 parameters, bf16 autocast; micro-batches packed (thd: Transformer Engine's
  attention, or varlen flash attention in the local spec; right-padded where neither runs:
  :func:`~slime.backends.megatron_utils.forward.packs_micro_batches`), run through Megatron's
  pipeline schedule (:mod:`~slime.backends.megatron_utils.pipeline`) at any pipeline size; the last
  stage's forward-only results are broadcast to the other stages;
* optimizer: Megatron's distributed optimizer (``--optimizer-cpu-offload`` passed through) and
  ``OptimizerParamScheduler``; gradient clipping inside ``optimizer.step()``;
* hooks: ``--custom-megatron-init-path`` after set-up, the before-log-prob hook before every
  forward-only pass (the before-train-step hook is the training core's, for both backends);
* ``--megatron-config-path``: ``actor:`` / ``critic:`` flag overrides (:func:`~.setup.apply_megatron_config`);
* offload/onload for colocation: parameters, gradient buffers and optimizer state copied to host
  memory and their device storage freed, restored in place;
* the PPO critic (``role="critic"``): the same model with a value head as its output layer;
* MoE routing replay (``--use-routing-replay``, ``--use-rollout-routing-replay``):
  :mod:`~slime.backends.megatron_utils.routing_replay`.

Data layout: the ranks of one model-parallel group (TP × PP) and its context-parallel peers compute
one model together, so they form one data-parallel replica and receive the same shard
(``DataLayout(dp_rank, dp_size, replica_size=TP·PP·CP, loss_copies=TP·CP)``). Context parallelism:
:mod:`~slime.backends.megatron_utils.context_parallel` (packed CP chunks, K/V all-gathered, the
response-row values gathered back so every CP rank computes the same loss). Refusals:
:func:`~.setup.refuse_unsupported`.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
import torch.distributed as dist

from slime.backends.megatron_utils import checkpoint as ckpt
from slime.backends.megatron_utils import forward as fw
from slime.backends.megatron_utils import model as mm
from slime.backends.megatron_utils import setup
from slime.backends.megatron_utils import weight_mapping as wm
from slime.backends.megatron_utils.logprobs import log_probs_and_entropy
from slime.backends.megatron_utils.model_config import fill_model_args, hf_validate_args, load_hf_config
from slime.backends.megatron_utils.offload import offload_to_host, onload_from_host
from slime.backends.training.backend import DataLayout, ModelOutput, ModelOutputs, TrainBackend
from slime.backends.training.batch import TrainBatch
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)

__all__ = ["MegatronBackend", "CPU_TESTING_ENV"]

#: Megatron-Core needs CUDA; the CPU tests run it on gloo with its few CUDA-only calls redirected
#: (tests/backends/megatron_utils/megatron_cpu.py) and set this variable to let the backend start.
CPU_TESTING_ENV = "SLIME_MEGATRON_CPU_TESTING"


class MegatronBackend(TrainBackend):
    """One Megatron rank of the actor or of the PPO critic (``role="critic"``: the same GPTModel with a
    :class:`~slime.backends.megatron_utils.model.ValueHead` as its output layer, never tied to the
    embeddings; checkpoints under ``<save>/critic``)."""

    def __init__(self, args, role: str = "actor"):
        args = copy.copy(setup.apply_megatron_config(args, role))
        super().__init__(args, role)
        setup.refuse_unsupported(args)
        if not torch.cuda.is_available() and os.environ.get(CPU_TESTING_ENV) != "1":
            raise RuntimeError("--train-backend megatron needs CUDA GPUs; on CPU use --train-backend fsdp")
        self.rank = dist.get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = self.ddp_model = self.ref_model = self.optimizer = self.scheduler = None
        self.routing = None  # RoutingReplay of the actor model with --use-routing-replay
        self._routed = None  # this rollout step's rollout_routed_experts (R3)
        self.model_layout: wm.ModelLayout | None = None  # the HF <-> Megatron weight layout
        self._hf_config: dict = {}
        self._host_copies: dict = {}
        self.offloaded = False
        self.packed = False  # micro-batches packed (thd) rather than right-padded: set by init from the model

    # ------------------------------------------------------------------ set-up

    def _declare_layout(self) -> DataLayout:
        from megatron.core import parallel_state as ps

        tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
        return DataLayout(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                          replica_size=tp * ps.get_pipeline_model_parallel_world_size() * cp, loss_copies=tp * cp)

    def _load_weights(self, model, load: str | None, ckpt_step: int | None, finetune: bool,
                      optimizer=None, scheduler=None) -> int | None:
        """Weights (and, when resuming, optimizer/scheduler/RNG); returns the resumed iteration."""
        args = self.args
        choice = ckpt.resolve_checkpoint(load, ckpt_step, finetune)
        if choice.kind == "none":
            choice = ckpt.CheckpointChoice("hf", self._weights_dir())
        if choice.kind == "hf":  # the critic's value head came with the model (attach_value_head)
            mm.load_hf_weights(model, choice.path, self.model_layout, skip_prefixes=self._head_prefixes())
            return None
        extra = ckpt.load_checkpoint(choice, model, optimizer if choice.resume and not args.no_load_optim else None,
                                     scheduler, load_rng=not args.no_load_rng)
        if extra:
            self.global_step = int(extra.get("global_step", 0))
        return choice.iteration if choice.resume else None

    def _weights_dir(self) -> str:
        """The HF directory this role starts from (the critic: ``--critic-hf-checkpoint`` when set)."""
        if self.role == "critic":
            return self.args.critic_hf_checkpoint or self.args.hf_checkpoint
        return self.args.hf_checkpoint

    def _head_prefixes(self) -> tuple[str, ...]:
        return ("output_layer.",) if self.role == "critic" else ()

    def _checkpoint_dir(self, root: str | None) -> str | None:
        if root is None:
            return None
        return root if self.role == "actor" else os.path.join(root, "critic")

    def _model_shape(self) -> None:
        """Megatron's shape flags from the HF config, checked against it; the weight layout."""
        args = self.args
        hf_config = load_hf_config(args.hf_checkpoint)
        if fill_model_args(args, hf_config):
            logger.info("no model preset given: shape flags from %s/config.json", args.hf_checkpoint)
        hf_validate_args(args, hf_config)
        if self.role == "critic":
            args.untie_embeddings_and_output_weights = True  # the value head replaces the output layer
        if args.padded_vocab_size is None:
            args.padded_vocab_size = wm.padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                          args.tensor_model_parallel_size)
        self._hf_config = hf_config
        self.model_layout = mm.layout_for(args, hf_config)
        if self.model_layout.num_experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
            raise ValueError(
                f"--tensor-model-parallel-size {args.tensor_model_parallel_size} on an MoE model ({args.hf_checkpoint}) "
                "needs --sequence-parallel (Megatron-Core requires it for MoE training"
                + ("" if mm.have_sequence_parallel_norm() else ", and it needs Transformer Engine or Apex")
                + "); or split the experts with --expert-model-parallel-size and keep TP at 1")

    def _check_packing(self, model) -> None:
        args = self.args
        self.packed = fw.packs_micro_batches(model, self.device)
        if args.context_parallel_size > 1:
            from slime.backends.megatron_utils.packed_attention import supports_packing

            if not supports_packing(mm.unwrap(model)):
                raise ValueError(f"--context-parallel-size {args.context_parallel_size} needs the attention of "
                                 "slime.backends.megatron_utils.model.model_provider (PackedCoreAttention, RoPE); "
                                 "--custom-model-provider-path gave a model without it")
            self.packed = True  # CP chunks are packed rows (exact attention where flash attention does not run)
        if args.use_routing_replay:
            if not self.model_layout.num_experts:
                raise ValueError("--use-routing-replay / --use-rollout-routing-replay need an MoE model; "
                                 f"{args.hf_checkpoint} has no experts")
            from slime.backends.megatron_utils.routing_replay import RoutingReplay

            self.routing = RoutingReplay(model)

    def build_optimizer(self):
        """(optimizer, scheduler) of the wrapped model; tests that run without CUDA replace it."""
        lr = self.args.lr if self.role == "actor" else (self.args.critic_lr or self.args.lr)
        return setup.build_optimizer(self.args, self.ddp_model, lr)

    def init(self) -> int | None:
        args = self.args
        if args.hf_checkpoint is None:
            raise ValueError("--train-backend megatron needs --hf-checkpoint (config, tokenizer, and the HF weight names)")
        setup.init_parallel_state(args)
        self.layout = self._declare_layout()
        self._model_shape()
        model = setup.build_model(args, self.role, self.device, self._weights_dir(), trainable=True)
        self._check_packing(model)
        self.ddp_model = self.model = setup.wrap_ddp(model, args.check_for_nan_in_loss_and_grad)
        self.optimizer, self.scheduler = self.build_optimizer()
        start_iteration = self._load_weights(model, self._checkpoint_dir(args.load), args.ckpt_step, args.finetune,
                                             self.optimizer, self.scheduler)
        if hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()  # main params of the distributed optimizer follow the loaded weights
        if self.role == "actor" and (args.use_kl_loss or args.kl_coef != 0):
            self.ref_model = setup.build_model(args, self.role, self.device, self._weights_dir(), trainable=False)
            self._load_weights(self.ref_model, args.ref_load or args.hf_checkpoint, args.ref_ckpt_step, True)
            self.ref_model.to("cpu")  # parked in host memory between its passes
        hook = args.custom_megatron_init_path
        if hook:
            load_function(hook)(args)
        dist.barrier()
        return None if start_iteration is None else start_iteration + 1

    def has_model(self, which: str) -> bool:
        return {"model": self.model, "ref": self.ref_model, "old_actor": None}[which] is not None

    def hf_config(self) -> dict:
        return self._hf_config

    def weight_dtype(self) -> torch.dtype | None:
        return torch.bfloat16

    # ------------------------------------------------------------------ forward passes

    def inputs(self, batch: TrainBatch, micro_batch: list[int], full: bool = False) -> fw.MicroBatchInputs:
        """One micro-batch laid out for the model; ``full``: every position (custom loss), not only
        the response."""
        from megatron.core import parallel_state as ps

        tokens = [batch.tokens[i] for i in micro_batch]
        responses = [int(t.numel()) - 1 for t in tokens] if full else [int(batch.response_lengths[i]) for i in micro_batch]
        pad = self._tp_size() if self.args.sequence_parallel else 1
        return fw.micro_batch_inputs(tokens, responses, self.device, packed=self.packed, pad_multiple=pad,
                                     sample_indices=micro_batch, cp_size=ps.get_context_parallel_world_size(),
                                     cp_rank=ps.get_context_parallel_rank())

    def _outputs(self, inputs: fw.MicroBatchInputs, logits: torch.Tensor, output: ModelOutput) -> ModelOutputs:
        """The response rows' logits ``[K, V]`` (autocast dtype) as the loss's inputs; under context
        parallelism every CP rank gets the whole micro-batch's values and computes the same loss."""
        if output.kind == "values":  # the value head's one column
            return ModelOutputs(values=inputs.gather(logits[:, 0].float()))
        if output.kind == "logits":
            return ModelOutputs(logits=logits.float()[None])
        log_probs, entropy = log_probs_and_entropy(logits, inputs.targets, self.args.rollout_temperature,
                                                   with_entropy=output.entropy, entropy_grad=output.entropy_grad)
        return ModelOutputs(log_probs=inputs.gather(log_probs), entropy=inputs.gather(entropy))

    @torch.no_grad()
    def forward_only(self, which: str, batch: TrainBatch, output: ModelOutput):
        """Per-sample log-probs (and entropy), or the critic's values, over the training
        micro-batches, through the pipeline schedule; every stage receives the last stage's results."""
        model = {"model": self.model, "ref": self.ref_model}[which]
        if which == "ref":
            model.to(self.device)
        try:
            return self._forward_only(model, which, batch, output)
        finally:
            if which == "ref":
                model.to("cpu")

    def _forward_only(self, model, which: str, batch: TrainBatch, output: ModelOutput):
        from slime.backends.megatron_utils import pipeline

        hook = self.args.custom_megatron_before_log_prob_hook_path
        if hook and output.kind != "values":
            load_function(hook)(self.args, model, "ref_" if which == "ref" else "")
        self._routed = batch.rollout_routed_experts
        batches = [self.inputs(batch, mb) for mb in batch.schedule.micro_batch_indices if mb]

        def collect(inputs: fw.MicroBatchInputs, logits: torch.Tensor):
            result = self._outputs(inputs, logits, output)
            per_token = result.values if output.kind == "values" else result.log_probs
            zero = torch.zeros((), device=logits.device)
            if result.entropy is None:
                return zero, (per_token.float().cpu(), None)
            both = torch.stack([per_token.float(), result.entropy.float()]).cpu()  # one device-to-host copy
            return zero, (both[0], both[1])

        around = None
        if self.routing is not None and which == "model":  # π_old: R2 records the routing, R3 replays the engine's
            around = self._replay_rollout_routing if self.args.use_rollout_routing_replay else self.routing.record
        model.eval()
        payloads = pipeline.forward_backward(model, batches, collect, forward_only=True, vocab_size=self._output_width(),
                                             autocast_dtype=self._autocast_dtype(), around_forward=around)
        payloads = pipeline.broadcast_from_last_stage(payloads)
        if which == "model":
            model.train()
        n = len(batch.tokens)
        out: list = [torch.zeros(0)] * n
        entropy_out: list = [torch.zeros(0)] * n
        for inputs, (per_token, entropy) in zip(batches, payloads):
            for j, piece in zip(inputs.sample_indices, torch.split(per_token, inputs.response_lengths)):
                out[j] = piece
            if entropy is not None:
                for j, piece in zip(inputs.sample_indices, torch.split(entropy, inputs.response_lengths)):
                    entropy_out[j] = piece
        return out, (entropy_out if output.entropy else None)

    def _replay_rollout_routing(self, inputs: fw.MicroBatchInputs):
        """R3: replay the engine's expert choices for this micro-batch."""
        from megatron.core import parallel_state as ps

        from slime.backends.megatron_utils.routing_replay import rollout_targets

        routed = self._routed
        if routed is None or any(routed[i] is None for i in inputs.sample_indices):
            raise ValueError("--use-rollout-routing-replay needs rollout_routed_experts for every sample (the engine "
                             "returns them with return_routed_experts on a server started with --enable-return-routed-experts)")
        sp = self.args.sequence_parallel and self._tp_size() > 1
        targets = rollout_targets(inputs, [routed[i] for i in inputs.sample_indices], self.routing.layers,
                                  self.args.moe_router_topk, self.device,
                                  ps.get_tensor_model_parallel_rank() if sp else 0, self._tp_size() if sp else 1)
        return self.routing.replay(targets)

    def forward_backward(self, batch: TrainBatch, micro_batches: list[list[int]], output: ModelOutput, loss_fn):
        """Accumulate the gradients of one optimizer step through the pipeline schedule. Each
        micro-batch's loss is ``loss_fn``'s × dp·cp because Megatron's DDP averages gradients over the
        data(-and-context)-parallel ranks, so the reduced gradient is that of Σ loss_fn; returns the
        micro-batches' host metrics on the last stage (none elsewhere)."""
        from megatron.core import parallel_state as ps

        from slime.backends.megatron_utils import pipeline

        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        full = output.kind == "logits"
        self._routed = batch.rollout_routed_experts
        # a rank without samples in this step still joins the gradient reduction (finalize_model_grads)
        batches = [self.inputs(batch, mb, full) for mb in micro_batches if mb]

        def pipeline_loss(inputs: fw.MicroBatchInputs, logits: torch.Tensor):
            loss, metrics = loss_fn(inputs.sample_indices, self._outputs(inputs, logits, output))
            return loss * dp, metrics

        around = None
        if self.routing is not None:
            self.routing.start_step()
            around = self._replay_rollout_routing if self.args.use_rollout_routing_replay else \
                (lambda inputs: self.routing.replay(self.routing.recorded_targets(inputs)))
        self.model.train()
        return pipeline.forward_backward(self.model, batches, pipeline_loss, forward_only=False,
                                         vocab_size=self._output_width(), autocast_dtype=self._autocast_dtype(),
                                         around_forward=around)

    def finish_rollout_step(self) -> None:
        self._routed = None
        if self.routing is not None:
            self.routing.finish()

    def _output_width(self) -> int:
        """Columns of the last stage's output that mean something: the vocabulary (padding cut), or
        the critic's single value."""
        return 1 if self.role == "critic" else self.model_layout.vocab_size

    def _autocast_dtype(self) -> torch.dtype | None:
        # fp32 parameters, bf16 matmuls (DEVICE.md); the CPU tests stay in fp32
        return torch.bfloat16 if self.device.type == "cuda" else None

    def _tp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size()

    # ------------------------------------------------------------------ optimizer

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> tuple[float, list[float]]:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp_model])  # DP reduce (+ sequence-parallel norm grads)
        succeeded, grad_norm, _ = self.optimizer.step()
        if not succeeded:
            raise RuntimeError(f"optimizer step {self.global_step} failed (non-finite gradients)")
        self.scheduler.step(increment=1)
        return float(grad_norm or 0.0), [float(group["lr"]) for group in self.optimizer.param_groups]

    def reset_optimizer_state(self) -> None:
        from slime.backends.megatron_utils.offload import inner_optimizers

        for inner in inner_optimizers(self.optimizer):
            inner.state.clear()

    def copy_weights(self, source: str, target: str) -> None:
        if (source, target) != ("model", "ref"):
            raise ValueError(f"the Megatron backend copies weights from the model to the reference model only, not {source} -> {target}")
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
                 mm.iter_hf_weights(self.model, self.model_layout, torch.bfloat16, skip_prefixes=self._head_prefixes())}
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

    def named_hf_weights(self, dtype: torch.dtype | None):
        """HF-named full tensors (collective; every rank receives every tensor). MoE experts carry
        checkpoint names (SGLang), or transformers' fused 3-D names for the embedded engine."""
        named = mm.iter_hf_weights(self.model, self.model_layout, dtype, param_source=self.offloaded_param_source())
        if self.model_layout.num_experts and self.args.rollout_backend == "embedded":
            # the embedded engine loads by transformers' in-memory names (3-D expert tensors)
            named = wm.fuse_experts_for_transformers(named, self.model_layout)
        return named

    # ------------------------------------------------------------------ colocation

    def offloaded_param_source(self):
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
        collective = (self.layout.replica_size > 1 or ps.get_expert_model_parallel_world_size() > 1
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

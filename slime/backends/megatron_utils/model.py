"""Megatron-Core GPT models built from the flags / an HF config, HF weights in and out of them.

* :func:`transformer_config` — ``TransformerConfig`` from slime's Megatron-named flags (shape flags
  from a ``scripts/models`` preset, or filled from ``--hf-checkpoint`` when no preset is given).
* :func:`model_provider` — ``GPTModel`` with Transformer Engine layers when TE imports, else the
  local spec (Megatron-Core's own modules; runs on GPU under ``torch.autocast(bfloat16)``) with
  :class:`~.packed_attention.PackedCoreAttention` as its attention, so that it takes packed rows.
* :func:`load_hf_weights` — HF safetensors straight into the (TP/PP/EP-sharded) model: each rank
  reads only the tensors of its layers and keeps only its shard.
* :func:`iter_hf_weights` — the model's parameters as HF-named, HF-shaped full tensors: TP shards
  all-gathered, experts all-gathered over EP, pipeline stages broadcast, vocabulary padding removed.

Micro-batch layout and the forward to response logits are in :mod:`.forward`.

Megatron is imported inside functions: this module imports on a machine without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Iterator

import torch
import torch.distributed as dist

from slime.backends.megatron_utils import weight_mapping as wm

__all__ = ["ValueHead", "attach_value_head", "VALUE_HEAD_FILE", "have_transformer_engine", "transformer_config", "model_provider",
           "layout_for", "load_hf_weights", "iter_hf_weights", "HFCheckpointReader", "unwrap", "build_model_for_layout_check"]


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def have_deepep() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("deep_ep") is not None


def have_sequence_parallel_norm() -> bool:
    """Sequence parallelism needs Transformer Engine's or Apex's norms (the torch fallback refuses it)."""
    return have_transformer_engine() or importlib.util.find_spec("apex") is not None


def transformer_config(args, **overrides):
    """``TransformerConfig`` from the parsed flags (parallel sizes, shape, MoE, precision);
    ``MLATransformerConfig`` under ``--multi-latent-attention``."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    bf16 = not args.fp16
    moe = bool(args.num_experts)
    kwargs = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size or (1 if moe else args.tensor_model_parallel_size),
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        # fp32 master parameters; the matmuls run in bf16 under autocast (DEVICE.md: no TE/Apex needed)
        params_dtype=torch.float32, bf16=False, fp16=False,
        # what crosses pipeline stages is the residual stream, which stays in the parameters' fp32
        # under autocast (embedding output + bf16 sub-layer outputs); p2p buffers take this dtype
        pipeline_dtype=torch.float32,
        autocast_dtype=torch.bfloat16 if bf16 else torch.float16,
        variable_seq_lengths=True, attention_softmax_in_fp32=True,
        # fused kernels that need Apex / TE / compiled extensions: never on (the --no-*-fusion flags say so)
        masked_softmax_fusion=args.masked_softmax_fusion,
        bias_activation_fusion=args.bias_swiglu_fusion or args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        apply_rope_fusion=args.apply_rope_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion, persist_layer_norm=False,
        rotary_interleaved=args.rotary_interleaved,
        deterministic_mode=args.deterministic_mode,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        calculate_per_token_loss=False,
        # Megatron rejects its default "allgather" dispatcher with variable sequence lengths, even
        # for dense models (which never dispatch); "alltoall" needs CUDA streams, so MoE models on
        # the CPU (tools, layout checks) use allgather with fixed lengths
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() or not moe else "allgather",
    )
    if not torch.cuda.is_available() and moe:
        kwargs["variable_seq_lengths"] = False
    # uneven pipeline stages (the layer ranges of weight_mapping.pp_layer_range)
    if args.decoder_first_pipeline_num_layers is not None:
        kwargs["num_layers_in_first_pipeline_stage"] = args.decoder_first_pipeline_num_layers
    if args.decoder_last_pipeline_num_layers is not None:
        kwargs["num_layers_in_last_pipeline_stage"] = args.decoder_last_pipeline_num_layers
    if moe:
        kwargs.update(
            num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_topk=args.moe_router_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax, moe_router_score_function=args.moe_router_score_function,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=args.moe_shared_expert_gate, moe_layer_freq=args.moe_layer_freq,
            moe_token_dispatcher_type=kwargs["moe_token_dispatcher_type"] if args.moe_token_dispatcher_type == "allgather"
            else args.moe_token_dispatcher_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_grouped_gemm=args.moe_grouped_gemm, moe_router_dtype=args.moe_router_dtype or "fp32",
            moe_enable_routing_replay=bool(args.use_routing_replay),
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_token_drop_policy=args.moe_token_drop_policy,
            moe_permute_fusion=args.moe_permute_fusion,
        )
        if args.moe_enable_deepep:  # refused at start without CUDA and deep_ep
            kwargs.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    kwargs.update(overrides)
    kwargs.update(megatron_lm_config_fields(args, set(kwargs)))
    if args.multi_latent_attention:
        kwargs.update(mla_config_kwargs(args))
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def megatron_lm_config_fields(args, set_by_slime: set[str]) -> dict:
    """The TransformerConfig fields given by their own Megatron-LM flag (slime/utils/megatron_lm_flags.py),
    for Megatron-Core as they are; a field slime derives from other flags cannot also be set directly."""
    from slime.utils.arguments_groups import megatron_lm_passthrough_dests

    fields = {dest: getattr(args, dest) for dest in megatron_lm_passthrough_dests() if getattr(args, dest, None) is not None}
    clash = sorted(set(fields) & set_by_slime)
    if clash:
        flags = ", ".join("--" + d.replace("_", "-") for d in clash)
        raise ValueError(f"{flags}: slime sets these TransformerConfig fields from its own flags; drop them")
    return fields


def llama_rope_scaling_factor(args) -> float:
    """The Llama 3.1 factor of ``--use-rope-scaling``: ``--rope-scaling-factor``, or upstream's spelling
    ``--rotary-scaling-factor`` when that is set (without MLA; validate_args refuses two different values)."""
    rotary = args.rotary_scaling_factor
    if rotary != 1.0 and not args.multi_latent_attention:
        return float(rotary)
    return float(args.rope_scaling_factor)


def mla_config_kwargs(args) -> dict:
    """The MLA fields of ``MLATransformerConfig`` from the flags: LoRA ranks, head sizes, YaRN."""
    return dict(
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        rope_type=args.rope_type or "yarn", rotary_base=float(args.rotary_base),
        rotary_scaling_factor=args.rotary_scaling_factor, mscale=args.mscale, mscale_all_dim=args.mscale_all_dim,
        original_max_position_embeddings=args.yarn_original_max_position_embeddings,
        beta_fast=args.yarn_beta_fast, beta_slow=args.yarn_beta_slow,
    )


def custom_spec(args, config, vp_stage: int | None):
    """``--spec MODULE FUNCTION`` (or ``--spec MODULE.FUNCTION``): a ModuleSpec object, or a function
    ``(args, config, vp_stage) -> ModuleSpec``; None without the flag."""
    spec = args.spec
    if not spec:
        return None
    from slime.utils.misc import load_function

    if len(spec) == 2:
        path = f"{spec[0]}.{spec[1]}"
    elif len(spec) == 1 and "." in spec[0]:
        path = spec[0]
    else:
        raise ValueError(f"--spec {' '.join(spec)}: expected 'MODULE FUNCTION' or 'MODULE.FUNCTION'")
    target = load_function(path)
    from megatron.core.transformer.spec_utils import ModuleSpec

    result = target if isinstance(target, ModuleSpec) else target(args, config, vp_stage)
    if not isinstance(result, ModuleSpec) and not hasattr(result, "layer_specs"):
        raise TypeError(f"--spec {path} gave a {type(result).__name__}, not a Megatron ModuleSpec / block spec")
    return result


def _layer_spec(args, config, vp_stage: int | None):
    spec = custom_spec(args, config, vp_stage)
    if spec is not None:
        return spec
    spec = _built_in_spec(args, config, vp_stage)
    if args.post_self_attn_layernorm:  # GLM-4 (with --post-mlp-layernorm: start-up checks both)
        from slime.backends.megatron_utils.sandwich_norm import with_sandwich_norms

        spec = with_sandwich_norms(spec)
    return spec


def _built_in_spec(args, config, vp_stage: int | None):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    mla = args.multi_latent_attention

    # context parallelism runs through the local spec's PackedCoreAttention (context_parallel.py)
    use_te = have_transformer_engine() and (args.context_parallel_size or 1) == 1
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                          vp_stage=vp_stage)
    elif use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm, multi_latent_attention=mla)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization,
                                        multi_latent_attention=mla)
    if use_te:
        return spec
    if mla:  # Megatron-Core's local attention cannot take MLA's key/value widths; micro-batches are padded
        from slime.backends.megatron_utils.latent_attention import LatentCoreAttention
        from slime.backends.megatron_utils.packed_attention import replace_core_attention

        return replace_core_attention(spec, LatentCoreAttention)
    from slime.backends.megatron_utils.packed_attention import use_packed_core_attention

    return use_packed_core_attention(spec)  # the local spec's attention, taking packed rows too


def model_provider(args, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, config=None):
    """The ``GPTModel`` of this rank's pipeline stage (``--custom-model-provider-path`` replaces it)."""
    from megatron.core.models.gpt import GPTModel

    if args.enable_experimental:  # Megatron-Core reads its switch where a feature runs
        from megatron.core.config import set_experimental_flag

        set_experimental_flag(True)
    config = config or transformer_config(args)
    model = GPTModel(
        config=config, transformer_layer_spec=_layer_spec(args, config, vp_stage), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings or args.seq_length, pre_process=pre_process,
        post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_percent=args.rotary_percent, rotary_base=int(args.rotary_base),
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=llama_rope_scaling_factor(args), vp_stage=vp_stage,
    )
    _routers_outside_autocast(model)
    return model


def _routers_outside_autocast(model) -> None:
    """Run every MoE router's gating matmul with autocast off, so ``moe_router_dtype="fp32"`` really
    routes in fp32. Megatron-Core's gating function casts its inputs to fp32 but autocast would turn
    its matmul back to bf16, and its backward (run without autocast) then multiplies a bf16 gradient
    by the fp32 weight and fails; Transformer Engine's GEMM, used when installed, is not autocast."""
    from megatron.core.transformer.moe.router import Router

    for module in model.modules():
        if isinstance(module, Router) and not getattr(module, "_slime_fp32_gating", False):
            gating = module.gating

            def fp32_gating(input, _gating=gating):
                with torch.autocast(device_type=input.device.type, enabled=False):
                    return _gating(input)

            module.gating = fp32_gating
            module._slime_fp32_gating = True


def build_model_for_layout_check(hf_config: dict, layout: wm.ModelLayout):
    """A single-rank CPU GPTModel of ``hf_config`` (local spec), to compare parameter names and
    shapes with the mapping; sets up a one-process gloo group and model-parallel state if needed."""
    from megatron.core import parallel_state

    from slime.backends.megatron_utils.model_config import model_args_from_hf_config
    from slime.utils.arguments_groups import flag_defaults

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    args = flag_defaults(**model_args_from_hf_config(hf_config))
    args.__dict__.update(hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=1,
                         pipeline_model_parallel_size=1, context_parallel_size=1, expert_model_parallel_size=1,
                         expert_tensor_parallel_size=1, sequence_parallel=False, recompute_granularity=None,
                         recompute_method=None, recompute_num_layers=None,
                         moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                         moe_router_load_balancing_type="none", moe_grouped_gemm=False,
                         padded_vocab_size=layout.padded_vocab_size, max_position_embeddings=256, seq_length=256,
                         rotary_percent=1.0, fp16=False)
    config = transformer_config(args, use_cpu_initialization=True, moe_token_dispatcher_type="allgather",
                                variable_seq_lengths=False)
    spec = _layer_spec(args, config, None)
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size, max_sequence_length=256,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type="rope", rotary_base=int(args.rotary_base))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def layout_for(args, hf_config: dict) -> wm.ModelLayout:
    """The weight-mapping layout of the model this process builds (TE fused norms when TE is used)."""
    return wm.ModelLayout.from_hf_config(hf_config, padded_vocab=args.padded_vocab_size,
                                         te_fused_norms=have_transformer_engine(),
                                         grouped_experts=have_transformer_engine() and args.moe_grouped_gemm)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


# --------------------------------------------------------------------------- the critic's value head

VALUE_HEAD_FILE = "value_head.safetensors"  # the FSDP critic's file: {"weight": [1, H], "bias": [1]}


class ValueHead(torch.nn.Module):
    """The PPO critic's output layer in place of ``GPTModel.output_layer``: V = w·h + b at every
    position, ``[s, b, 1]``. Replicated over TP ranks (one output column cannot be split); with
    sequence parallelism the hidden states are gathered first, and the backward takes each rank's
    own slice (every TP rank computes the same loss over the whole sequence)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


@torch.no_grad()
def attach_value_head(model: torch.nn.Module, weights_dir: str | None, seed: int) -> None:
    """Replace the last stage's output layer by a :class:`ValueHead`: from ``weights_dir``'s
    ``value_head.safetensors`` when there is one (a critic saved by either backend), else
    N(0, 0.02) weights and a zero bias drawn from ``seed`` (the same on every rank)."""
    gpt = unwrap(model)
    if not getattr(gpt, "post_process", False):
        return
    old = gpt.output_layer
    head = ValueHead(gpt.config.hidden_size, gpt.config.sequence_parallel and gpt.config.tensor_model_parallel_size > 1)
    path = os.path.join(weights_dir, VALUE_HEAD_FILE) if weights_dir else None
    if path and os.path.exists(path):
        from safetensors.torch import load_file

        state = load_file(path)
        if tuple(state["weight"].shape) != (1, gpt.config.hidden_size):
            raise ValueError(f"{path}: value head weight of shape {tuple(state['weight'].shape)}, the model needs "
                             f"(1, {gpt.config.hidden_size})")
        head.weight.copy_(state["weight"])
        head.bias.copy_(state["bias"])
    else:
        generator = torch.Generator().manual_seed(seed)
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.02)
    gpt.output_layer = head.to(device=old.weight.device if getattr(old, "weight", None) is not None else "cpu")
    del old


# --------------------------------------------------------------------------- HF weights in

class HFCheckpointReader:
    """Lazy tensor reader over an HF directory's ``*.safetensors`` (sharded or not)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors weights")
        self.path = path
        self._handles = {f: safe_open(os.path.join(path, f), framework="pt") for f in files}
        self._where = {name: f for f, h in self._handles.items() for name in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return self._handles[self._where[name]].get_tensor(name)


def _rank_info():
    from megatron.core import parallel_state as ps

    return dict(
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
    )


def _weights(gpt: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors that carry HF weights: every parameter, and the routers' expert bias (a buffer
    Megatron updates outside the optimizer; HF's ``e_score_correction_bias``)."""
    yield from gpt.named_parameters()
    for name, buffer in gpt.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buffer


def _global_names(model: torch.nn.Module, layout: wm.ModelLayout, ep_rank: int, ep_size: int) -> dict[str, str]:
    """Local parameter name -> global name (layer offsets from each layer's ``layer_number``)."""
    gpt = unwrap(model)
    layer_offset = {}
    if hasattr(gpt, "decoder"):
        for local, layer in enumerate(gpt.decoder.layers):
            layer_offset[local] = layer.layer_number - 1 - local
    experts_per_rank = layout.num_experts // ep_size if layout.num_experts else 0
    out = {}
    for name, _ in _weights(gpt):
        offset = 0
        if name.startswith("decoder.layers."):
            offset = layer_offset[int(name.split(".")[2])]
        out[name] = wm.globalize_name(name, offset, ep_rank * experts_per_rank)
    return out


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_path: str, layout: wm.ModelLayout, skip_prefixes: tuple[str, ...] = ()) -> int:
    """Copy the HF checkpoint at ``hf_path`` into this rank's shards; returns tensors loaded.
    Parameters under ``skip_prefixes`` (the critic's value head) are left alone."""
    ranks = _rank_info()
    reader = HFCheckpointReader(hf_path)
    gpt = unwrap(model)
    names = _global_names(gpt, layout, ranks["ep_rank"], ranks["ep_size"])
    count = 0
    for local_name, param in _weights(gpt):
        if skip_prefixes and local_name.startswith(skip_prefixes):
            continue
        global_name = names[local_name]
        full = wm.hf_to_megatron_tensor(global_name, reader, layout)
        if wm.is_expert_param(global_name):
            shard = wm.tp_split(global_name, full, ranks["etp_size"])[ranks["etp_rank"]]
        else:
            shard = wm.tp_split(global_name, full, ranks["tp_size"])[ranks["tp_rank"]]
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{hf_path}: {global_name} gives a shard of shape {tuple(shard.shape)}, the model's "
                             f"{local_name} is {tuple(param.shape)} (does the preset match the checkpoint?)")
        param.copy_(shard.to(device=param.device, dtype=param.dtype))
        count += 1
    return count


# --------------------------------------------------------------------------- HF weights out

def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, layout: wm.ModelLayout, dtype: torch.dtype | None = None,
                    skip_prefixes: tuple[str, ...] = (), param_source=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model, full and HF-shaped, on every rank. Collective over all ranks
    (TP all-gathers, EP all-gathers, and a broadcast per pipeline stage): every rank must iterate
    to the end. Parameters under ``skip_prefixes`` (the critic's value head) are not exported.
    ``param_source(param)`` gives the tensor to read for a parameter (an offloaded model's host
    copy) instead of the parameter itself."""
    from megatron.core import parallel_state as ps

    ranks = _rank_info()
    gpt = unwrap(model)
    names = _global_names(gpt, layout, 0, 1)  # expert indices stay local here; EP gather below renumbers
    experts_per_rank = layout.num_experts // ranks["ep_size"] if layout.num_experts else 0
    local: list[tuple[str, torch.Tensor]] = []
    for local_name, param in _weights(gpt):
        if skip_prefixes and local_name.startswith(skip_prefixes):
            continue
        name = names[local_name]
        # (buffers are never offloaded: only parameters have a host copy)
        tensor = param.detach() if param_source is None or not isinstance(param, torch.nn.Parameter) else param_source(param)
        if wm.is_expert_param(name):
            full = wm.tp_merge(name, _gather(tensor, ps.get_expert_tensor_parallel_group()))
            for ep_rank, part in enumerate(_gather(full, ps.get_expert_model_parallel_group())):
                local.append((wm.globalize_name(name, 0, ep_rank * experts_per_rank), part))
        else:
            local.append((name, wm.tp_merge(name, _gather(tensor, ps.get_tensor_model_parallel_group()))))
    for name, tensor in _broadcast_pipeline(local):
        for hf_name, hf_tensor in wm.megatron_to_hf_tensors(name, tensor, layout):
            yield hf_name, (hf_tensor.to(dtype) if dtype is not None else hf_tensor).contiguous()


def _broadcast_pipeline(local: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each pipeline stage's tensors, in stage order, on every rank of the pipeline group."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        yield from local
        return
    metadata: list = [None] * size
    dist.all_gather_object(metadata, [(n, tuple(t.shape), t.dtype) for n, t in local], group=group)
    me = dist.get_rank(group)
    mine = dict(local)
    device = next(iter(mine.values())).device if mine else torch.device("cuda", torch.cuda.current_device())
    for stage, entries in enumerate(metadata):
        source = dist.get_global_rank(group, stage)
        for name, shape, dtype in entries:
            tensor = mine[name] if stage == me else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=source, group=group)
            yield name, tensor

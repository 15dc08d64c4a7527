"""Fused projections: an attention layer's q/k/v as one GEMM, an MLP's gate/up as one GEMM.

A decode step of a small model is launch-bound: on an H200 a 0.6B Qwen3 at batch 16 spends ~4.6 µs
per cuBLAS GEMM whatever its size, and Hugging Face's layers run five of them (q, k, v, gate, up)
where two would do. :func:`install` concatenates the weights of each group along the output rows,
``[q; k; v]`` ``[(Hq + 2·Hkv)·D, hidden]`` and ``[gate; up]`` ``[2·I, hidden]`` (biases likewise,
as in Qwen2), into one ``nn.Linear`` per group (``qkv_proj`` / ``gate_up_proj``), removes the
separate modules and gives the parent a forward that splits the one output. Each output element is
the same dot product as before, so the result equals the unfused model's to GEMM rounding.

The fused weight is the only storage: nothing else holds a view of it, so ``model.to()`` (the memory
saver's release and resume, which rebind ``param.data``) moves it like any parameter. The
Hugging Face names keep working through :func:`projection_slice`, which maps
``...self_attn.k_proj.weight`` to its rows of ``...self_attn.qkv_proj.weight`` (a view): weight
updates by name copy into those rows, ``/get_weights_by_name`` reads them, and the parameters'
byte count is unchanged.

Families: the attention and MLP classes of Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3 and Qwen3-MoE
(the MoE shared expert and dense layers are such MLPs; routed experts are transformers' own fused
parameters and stay as they are). Other modules are left alone.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import types

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: attention class -> how its Hugging Face forward picks ``sliding_window`` for the attention function
ATTENTION_CLASSES = {"LlamaAttention": None, "Qwen2MoeAttention": None, "MistralAttention": "config",
                     "Qwen2Attention": "module", "Qwen3Attention": "module", "Qwen3MoeAttention": "module"}
MLP_CLASSES = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "Qwen3MoeMLP"}
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")

_PART_NAME = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class FusedLinear(nn.Linear):
    """One ``nn.Linear`` whose output rows are several projections side by side: ``parts`` maps each
    original module name to its ``(start, end)`` rows; :meth:`split` cuts an output into them."""

    def __init__(self, linears: dict[str, nn.Linear]):
        first = next(iter(linears.values()))
        sizes = [linear.out_features for linear in linears.values()]
        super().__init__(first.in_features, sum(sizes), bias=first.bias is not None, device="meta")
        self.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears.values()]),
                                   requires_grad=False)
        if first.bias is not None:
            self.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears.values()]),
                                     requires_grad=False)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.parts = {name: (start, start + size) for name, start, size in zip(linears, starts, sizes)}
        self.sizes = sizes

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.sizes, dim=-1)


def _fusable(linears: list, row_multiple: int) -> bool:
    """Plain linears (not FP8 or other replacements) over the same input, all with or without bias, each
    a whole number of ``row_multiple`` output rows."""
    if not all(type(linear) is nn.Linear for linear in linears):
        return False
    first = linears[0]
    return all(linear.in_features == first.in_features and (linear.bias is None) == (first.bias is None)
               and linear.out_features % row_multiple == 0
               and linear.weight.dtype == first.weight.dtype and linear.weight.device == first.weight.device
               for linear in linears)


def _fuse(module: nn.Module, names: tuple[str, ...], fused_name: str, row_multiple: int) -> bool:
    linears = [getattr(module, name, None) for name in names]
    if not _fusable(linears, row_multiple):
        return False
    fused = FusedLinear(dict(zip(names, linears)))
    for name in names:
        delattr(module, name)  # frees the separate weights: the fused copy is the storage now
    setattr(module, fused_name, fused)
    module.fused_projections = {**getattr(module, "fused_projections", {}), **{name: fused_name for name in names}}
    return True


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                       attention_mask: torch.Tensor | None, cache=None, *, modeling, sliding_window: str | None,
                       **kwargs):
    """The Hugging Face attention forward of these families with one q/k/v GEMM."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings
    norm_rope = getattr(self, "fused_norm_rope", None)  # fused_ops.install (CUDA): q/k norm + rotary, one kernel
    defers = getattr(self.qkv_proj, "defers_scales", None)  # fp8_channel's cublas backend: the kernel scales q/k/v
    if getattr(norm_rope, "takes_scales", False) and defers is not None \
            and defers(hidden_states.numel() // hidden_states.shape[-1], hidden_states.device):
        qkv, scales = self.qkv_proj.forward_unscaled(hidden_states)
        rotated = norm_rope(qkv, cos, sin, cache=cache, scales=scales)
    else:
        qkv, scales = self.qkv_proj(hidden_states), None
        rotated = None if norm_rope is None else norm_rope(qkv, cos, sin, cache=cache)
    written = rotated is not None and rotated[1] is None  # the kernel stored this step's keys and values itself
    if scales is not None and not written:  # someone else reads (some of) the product: scale it
        from slime.backends.embedded_engine.fp8.channel import apply_scales

        qkv = apply_scales(qkv, scales)
    query, key, value = (part.view(hidden_shape) for part in self.qkv_proj.split(qkv))
    value = value.transpose(1, 2)
    if rotated is not None:
        query, key = rotated
    else:
        if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over each head
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)  # looked up per call: fused_ops may patch it
    if written:
        key, value = cache.read(self.layer_idx)
    elif cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, modeling.eager_attention_forward)
    window = {"config": getattr(self.config, "sliding_window", None),
              "module": getattr(self, "sliding_window", None)}.get(sliding_window)
    dropout = self.attention_dropout if self.training else 0.0
    out, weights = attention(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                             sliding_window=window, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
    return self.down_proj(self.act_fn(gate) * up)


def install(model: nn.Module, row_multiple: int = 1) -> dict:
    """Fuse the q/k/v and gate/up projections of ``model`` in place; return how many of each.
    ``row_multiple``: fuse a group only where each part is a whole number of that many rows (FP8's
    128-row weight blocks: then no block straddles two parts, and a part's update by name re-quantizes
    only its own blocks)."""
    counts = {"qkv": 0, "gate_up": 0}
    for module in model.modules():
        name = type(module).__name__
        if name in ATTENTION_CLASSES and all(hasattr(module, a) for a in ("head_dim", "scaling", "layer_idx", "o_proj")):
            if _fuse(module, QKV, "qkv_proj", row_multiple):
                modeling = importlib.import_module(type(module).__module__)
                forward = functools.partial(_attention_forward, modeling=modeling,
                                            sliding_window=ATTENTION_CLASSES[name])
                module.forward = types.MethodType(forward, module)
                counts["qkv"] += 1
        elif name in MLP_CLASSES and hasattr(module, "act_fn") and hasattr(module, "down_proj"):
            if _fuse(module, GATE_UP, "gate_up_proj", row_multiple):
                module.forward = types.MethodType(_mlp_forward, module)
                counts["gate_up"] += 1
    if any(counts.values()):
        logger.info("fused projections: %s", counts)
    return counts


def projection_slice(model: nn.Module, name: str) -> torch.Tensor | None:
    """The rows of a fused projection that the Hugging Face tensor ``name`` (e.g.
    ``model.layers.0.self_attn.k_proj.weight``) is, as a view; None when ``name`` is no such part."""
    match = _PART_NAME.match(name)
    if match is None:
        return None
    path, part, kind = match.groups()
    try:
        parent = model.get_submodule(path)
    except AttributeError:
        return None
    fused_name = getattr(parent, "fused_projections", {}).get(part)
    if fused_name is None:
        return None
    fused = getattr(parent, fused_name)
    tensor = getattr(fused, kind)
    if tensor is None:
        return None
    start, end = fused.parts[part]
    return tensor[start:end]

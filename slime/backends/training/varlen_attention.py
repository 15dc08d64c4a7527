"""Packed (padding-free) attention on GPU through PyTorch's own varlen flash attention.

A packed micro-batch is one row ``[1, T]`` holding several samples. Without the ``flash_attn``
package, transformers' SDPA path needs a dense block-diagonal ``[T, T]`` mask, which makes SDPA
compute attention over the whole row (``O(T²)`` for every sample, mostly masked) with its slower
masked kernels. ``torch.nn.attention.varlen.varlen_attn`` runs the flash kernel over each sample
alone from the cumulative sample lengths (``cu_seqlens``), causal within a sample.

Registered with transformers as ``attn_implementation="slime_varlen"``; the model forward receives
``cu_seq_lens_q/k`` and ``max_length_q/k`` (the keyword arguments transformers forwards to attention
functions) and no mask.
"""

from __future__ import annotations

import inspect

import torch

VARLEN_NAME = "slime_varlen"
_registered = False


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def available() -> bool:
    """True on CUDA with a PyTorch that ships ``varlen_attn``."""
    return torch.cuda.is_available() and _varlen_fn() is not None


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                             max_length_q: int | None = None, max_length_k: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """``query/key [1, H|Hkv, T, D]``, ``value [1, Hkv, T, Dv]`` -> ``[1, T, H, Dv]``, causal per sample."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError("slime_varlen attention needs a packed batch [1, T] and cu_seq_lens_q/k "
                         "(a packed batch of one row, as both trainer backends build)")
    varlen_attn = _varlen_fn()
    params = inspect.signature(varlen_attn).parameters
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    extra = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    cu = cu_seq_lens_q.to(torch.int32)
    cu_k = cu if cu_seq_lens_k is None else cu_seq_lens_k.to(torch.int32)
    max_q = int(max_length_q)
    max_k = int(max_length_k if max_length_k is not None else max_length_q)
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v, value_dim = _same_head_size(q, k, v)
    out = varlen_attn(q, k, v, cu, cu_k, max_q, max_k, scale=scale, **extra)
    return out[..., :value_dim].unsqueeze(0), None


def _same_head_size(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The flash kernel wants one head size for queries, keys and values; multi-latent attention
    (DeepSeek-V3: 192 for q/k, 128 for v) has two. Zero columns change nothing: padded value columns
    give zero output columns (cut off after), padded query/key columns add nothing to the scores
    (the scale is taken from the unpadded size). Returns ``(q, k, v, value head size)``."""
    qk_dim, value_dim = q.shape[-1], v.shape[-1]
    if value_dim < qk_dim:
        v = torch.nn.functional.pad(v, (0, qk_dim - value_dim))
    elif value_dim > qk_dim:
        q = torch.nn.functional.pad(q, (0, value_dim - qk_dim))
        k = torch.nn.functional.pad(k, (0, value_dim - qk_dim))
    return q, k, v, value_dim


def _no_mask(*args, **kwargs):
    return None


def register() -> str:
    """Make ``attn_implementation="slime_varlen"`` known to transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(VARLEN_NAME, varlen_attention_forward)
        AttentionMaskInterface.register(VARLEN_NAME, _no_mask)
        _registered = True
    return VARLEN_NAME

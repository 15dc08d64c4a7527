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
import logging

import torch

logger = logging.getLogger(__name__)

VARLEN_NAME = "slime_varlen"
_registered = False


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_gradients_checked: dict[str, bool] = {}


def available() -> bool:
    """True on CUDA with a PyTorch whose ``varlen_attn`` trains: it exists, and one tiny packed
    forward/backward gives q, k and v the gradients SDPA gives (checked once a process)."""
    if not torch.cuda.is_available() or _varlen_fn() is None:
        return False
    if "cuda" not in _gradients_checked:
        _gradients_checked["cuda"] = gradients_match_sdpa(_varlen_fn(), torch.device("cuda"), torch.bfloat16)
        if not _gradients_checked["cuda"]:
            logger.warning("torch %s: varlen_attn's backward does not give q, k and v SDPA's gradients; packed "
                           "micro-batches use sdpa with a block-causal mask instead", torch.__version__)
    return _gradients_checked["cuda"]


def gradients_match_sdpa(varlen_attn, device: torch.device, dtype: torch.dtype, tolerance: float = 0.05) -> bool:
    """One packed batch of two causal samples through ``varlen_attn``'s causal forward and backward against
    SDPA per sample: every one of q, k and v must get a gradient within ``tolerance`` of SDPA's (relative to
    its largest value; bf16 rounding is ~1e-2). A kernel whose backward leaves out an input would train
    a model whose attention projections never move."""
    lengths, heads, dim = (5, 11), 2, 64
    generator = torch.Generator().manual_seed(0)
    base = [torch.randn(sum(lengths), heads, dim, generator=generator).to(device, dtype) for _ in range(3)]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    q, k, v = (t.clone().requires_grad_(True) for t in base)
    try:
        out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), scale=dim ** -0.5, **causal)
        out.float().square().sum().backward()
    except Exception as error:  # noqa: BLE001 — any failure means the kernel cannot be used for training
        logger.warning("varlen_attn's forward/backward failed on a tiny batch: %s", error)
        return False
    ref = [t.clone().requires_grad_(True) for t in base]
    outs = []
    for start, end in ((0, lengths[0]), (lengths[0], sum(lengths))):
        rq, rk, rv = (t[start:end].transpose(0, 1).unsqueeze(0) for t in ref)
        outs.append(torch.nn.functional.scaled_dot_product_attention(rq, rk, rv, is_causal=True)[0].transpose(0, 1))
    torch.cat(outs).float().square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in ref)):
        if got is None or not bool(torch.isfinite(got).all()):
            return False
        scale = float(want.float().abs().max()) or 1.0
        if float((got.float() - want.float()).abs().max()) > tolerance * scale:
            return False
    return True


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

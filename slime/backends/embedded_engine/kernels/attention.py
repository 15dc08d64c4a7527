"""The engine's attention function, registered with transformers as ``slime_slot``.

Prefill (several query tokens per row) goes to transformers' own SDPA implementation. Decode (one
query token per row, or a verify step's ``T`` tokens: the runner's decode forward passes ``slot_decode``)
is memory-bound: what matters is reading each row's cached keys and values
once. SDPA with an explicit mask falls back to repeating the key/value heads for grouped-query
attention (a full copy of the step's KV per layer), so decode uses two batched matmuls over the
key/value heads instead::

    q  [B, H, T, D] -> [B*Hkv, G*T, D]      (G = H / Hkv query heads share one KV head)
    s  = q @ K^T * scale + mask             [B*Hkv, G*T, L]   (fp32 softmax)
    o  = softmax(s) @ V                      [B*Hkv, G*T, D] -> [B, T, H, D]

K and V are the cache rows of the batch as strided views (no copy); the mask is the additive
``[B, 1, T, L]`` mask of the model runner (a position is visible iff it is <= the token's position).
Every operation has static shapes, so the decode step can be captured in a CUDA graph.

On CUDA with Triton the model runner passes ``slot_lengths`` (each row's length, on the device) and
decode goes to the flash-decoding kernel of :mod:`triton_attention` instead, which reads each row
only up to its own length (``--attention-backend triton``, the default there). With an FP8 cache
(``--kv-cache-dtype fp8_*``) that kernel gets the stored FP8 rows and the layer's scales
(``slot_kv_scales``) and dequantizes as it reads; every other path gets dequantized rows from the cache view.
"""

from __future__ import annotations

import torch

from slime.backends.embedded_engine.kv_cache import dequantize

ATTENTION_NAME = "slime_slot"
_registered = False


def slot_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    scales = kwargs.pop("slot_kv_scales", None)  # (k_scales, v_scales) per layer: the rows are the stored FP8 bytes
    k_scale, v_scale = (1.0, 1.0) if scales is None else (scales[0][module.layer_idx], scales[1][module.layer_idx])
    decode = query.shape[2] == 1 or kwargs.get("slot_decode", False)  # several tokens: a verify step's
    if not decode or attention_mask is None or kwargs.get("softcap") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if key.dtype != query.dtype:  # stored FP8 rows (a soft-capped decode): SDPA multiplies stored x scale
            key, value = dequantize(key, query.dtype, k_scale), dequantize(value, query.dtype, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    lengths = kwargs.get("slot_lengths")
    dim = query.shape[-1]
    if lengths is not None and triton_kernel_fits(dim, value.shape[-1]):
        from slime.backends.embedded_engine.kernels import triton_attention

        batch, heads, tokens = query.shape[:3]
        scale = dim ** -0.5 if scaling is None else scaling
        if tokens > 1:  # [B, H, T, D] -> [B, T, H, D]: each row's T tokens in one pass over its cache
            return triton_attention.decode_attention(query, key, value, lengths, key.shape[2], scale, k_scale,
                                                     v_scale), None
        out = triton_attention.decode_attention(query.reshape(batch, heads, dim), key, value, lengths, key.shape[2],
                                                scale, k_scale, v_scale)
        return out.view(batch, 1, heads, dim), None
    if key.dtype != query.dtype:  # stored FP8 rows: what the matmuls multiply is stored x scale
        key, value = dequantize(key, query.dtype, k_scale), dequantize(value, query.dtype, v_scale)
    return decode_attention(query, key, value, attention_mask, scaling), None


def triton_kernel_fits(key_dim: int, value_dim: int) -> bool:
    """Whether the flash-decoding kernel takes these heads: a power-of-two size >= 16, the same for keys
    and values (MLA's are not)."""
    return key_dim >= 16 and key_dim & (key_dim - 1) == 0 and value_dim == key_dim


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scaling: float | None) -> torch.Tensor:
    """``T`` query tokens per row (1 in a decode step, ``k + 1`` in a verify step): ``query [B, H, T, D]``,
    ``key [B, Hkv, L, D]``, ``value [B, Hkv, L, Dv]``, additive ``mask [B, 1, T, L]`` -> ``[B, T, H, Dv]``
    (the layout transformers' attention modules expect; ``Dv`` differs from ``D`` in multi-latent
    attention). The ``G = H / Hkv`` query heads of a KV head and the row's tokens share one matmul."""
    batch, heads, tokens, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    q = query.reshape(batch * kv_heads, groups * tokens, dim)
    k = _flat_heads(key)
    v = _flat_heads(value)
    scores = torch.bmm(q, k.transpose(1, 2)).float().view(batch, kv_heads, groups, tokens, length)
    scores = scores * scale + mask.float().view(batch, 1, 1, tokens, length)  # broadcasts over heads and groups
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(batch * kv_heads, groups * tokens, length)
    out = torch.bmm(probs, v).view(batch, heads, tokens, value.shape[-1])
    return out.transpose(1, 2)


def _flat_heads(t: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, L, D]`` -> ``[B*Hkv, L, D]``: a view when the cache rows allow it (they do for slot
    views: each row's heads are consecutive), else a copy."""
    batch, kv_heads, length, dim = t.shape
    try:
        return t.view(batch * kv_heads, length, dim)
    except RuntimeError:
        return t.reshape(batch * kv_heads, length, dim)


def register() -> str:
    """Make ``attn_implementation="slime_slot"`` known to transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTENTION_NAME, slot_attention_forward)
        # The runner always passes its own 4-D mask; the mask interface only has to know the name.
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME

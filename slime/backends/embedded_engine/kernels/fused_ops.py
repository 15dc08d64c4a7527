"""Fused Triton versions of the small per-layer operations of Llama/Qwen-style models, for CUDA.

A decode step of a 0.6B model at batch 128 is ~1,500 kernel launches, most of them elementwise
pieces of three operations that Hugging Face writes as several tensor ops each: RMSNorm (cast,
square, mean, rsqrt, multiply, cast, scale: ~7 kernels, four norms a layer in Qwen3), rotary
embeddings (multiply, slice, negate, concatenate, add for q and for k: ~10 kernels) and the SiLU
gate of the MLP (2 kernels). Inside a CUDA graph each still costs 1–3 µs of GPU time; one fused
kernel per operation removes ~30 launches per layer.

:func:`install` swaps them in on a loaded model, for the module classes and functions it knows
(the Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3 and Qwen3-MoE families) and leaves anything else as it
is. Every kernel follows the Hugging Face formula, with fp32 arithmetic in registers:

* RMSNorm: ``w * (x_fp32 * rsqrt(mean(x_fp32²) + eps)).to(x.dtype)`` (the cast before the weight, as
  HF does it);
* rotary: ``x * cos + rotate_half(x) * sin``, rounded once instead of after each op;
* residual add + RMSNorm (after the attention of each decoder layer): ``h = x + residual`` rounded
  to the activations' dtype, then the RMSNorm above of ``h``; both returned;
* SiLU gate: ``silu(g) * u`` (reading ``g`` and ``u`` from the one ``[gate | up]`` output where
  ``fused_projections.py`` has fused the two projections).

Results equal HF's to rounding (tests compare them in fp32 and bf16).

Under FP8 (``fp8.Fp8Linear`` projections whose GEMM at this token count is the two-kernel one) the
RMSNorms and the SiLU gate can also write their output's e4m3 activations (``quantize=True``: the
numbers of ``fp8_triton.quantize_activation``; ``quantize="token"`` for ``--quantization w8a8_fp8``: those
of ``fp8_channel.quantize_tokens``), which the decoder layer hands to the projection they feed, and the
MLP's residual add runs in the down GEMM's epilogue (:data:`FP8_QUANT_IN_PRODUCER`).
"""

from __future__ import annotations

import functools
import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from slime.backends.embedded_engine.kernels import small_gemm
from slime.backends.embedded_engine.kv_cache import FP8_DTYPES

if triton is not None:
    from slime.backends.embedded_engine.fp8.channel import _quantize_store_token, _quantize_token
    from slime.backends.embedded_engine.fp8.triton_kernels import FP8_MAX, _interpreting, _quantize_store_groups

logger = logging.getLogger(__name__)

RMSNORM_CLASSES = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
                   "Qwen3MoeRMSNorm"}
MLP_CLASSES = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "Qwen3MoeMLP"}
DECODER_LAYER_CLASSES = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen2MoeDecoderLayer",
                         "Qwen3DecoderLayer", "Qwen3MoeDecoderLayer"}
ROPE_MODULES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
MLP_RESIDUAL_IN_GEMM = True  # the MLP's residual add inside the down projection's GEMM (bench A/B switch)
SMALL_M_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # small_gemm.py's linears (decode-sized inputs)
KV_WRITE_IN_NORM_ROPE = True  # the decode step's KV-cache write inside the q/k norm + rotary kernel (A/B switch)
# FP8 projections on the two-kernel GEMM take their e4m3 activations from the RMSNorm / SiLU gate that
# produced them, and the MLP's residual add runs in the down GEMM's epilogue: fewer launches and reads of a decode
# step (docs/embedded_engine.md, block-wise FP8; ``bench/decode_step.py --without fp8_quant_in_producer``)
FP8_QUANT_IN_PRODUCER = True
# under fp8_channel's cublas backend the down projection leaves the layer unscaled and the next layer's input
# RMSNorm applies its scales and adds the residual (:class:`_HandOff`): cuBLASLt's down GEMM is the faster one
# (docs/performance.md)
DOWN_SCALES_TO_NEXT_LAYER = True


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_out, stride_sg, n_cols, eps, fp8_max,
                        BLOCK: tl.constexpr, QUANT: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)  # HF casts back first
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_out + cols, y, mask=inside)
        if QUANT == 1:  # and the e4m3 activations of the FP8 GEMM that reads this output (fp8_triton)
            _quantize_store_groups(y.to(tl.float32), row, 0, n_cols, q_ptr, s_ptr, n_cols, stride_sg, fp8_max,
                                   BLOCK, EMULATE_E4M3_CAST)
        elif QUANT == 2:  # per token (fp8_channel, --quantization w8a8_fp8)
            _quantize_store_token(y.to(tl.float32), row, n_cols, q_ptr, s_ptr, fp8_max, BLOCK, EMULATE_E4M3_CAST)

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, q_ptr, s_ptr, xs_ptr, cs_ptr, stride_x, stride_r,
                            stride_sg, n_cols, eps, fp8_max, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                            SCALED_X: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        # sum = x + residual, rounded to the activations' dtype as HF's add does; out = rmsnorm(sum). SCALED_X: x is an
        # unscaled FP8 product (fp8_channel.unscaled_mm), first scaled by its row's and columns' scales and rounded
        # to its dtype, as fp8_channel.apply_scales does
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        if SCALED_X:
            x = x * tl.load(xs_ptr + row) * tl.load(cs_ptr + cols, mask=inside, other=0.0)
            x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + cols, mask=inside, other=0.0).to(tl.float32)
        total = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, total, mask=inside)
        h = total.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / n_cols
        normed = (h * tl.math.rsqrt(variance + eps)).to(sum_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, y, mask=inside)
        if QUANT == 1:
            _quantize_store_groups(y.to(tl.float32), row, 0, n_cols, q_ptr, s_ptr, n_cols, stride_sg, fp8_max,
                                   BLOCK, EMULATE_E4M3_CAST)
        elif QUANT == 2:
            _quantize_store_token(y.to(tl.float32), row, n_cols, q_ptr, s_ptr, fp8_max, BLOCK, EMULATE_E4M3_CAST)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul_packed_kernel(gu_ptr, out_ptr, q_ptr, s_ptr, stride_gu, stride_sg, width, fp8_max,
                                BLOCK: tl.constexpr, QUANT: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        # row of [gate | up] (2 * width) -> row of silu(gate) * up (width)
        row = tl.program_id(0)
        first = tl.program_id(1) * BLOCK
        cols = first + tl.arange(0, BLOCK)
        inside = cols < width
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + width + cols, mask=inside, other=0.0).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * width + cols, y, mask=inside)
        if QUANT == 1:
            _quantize_store_groups(y.to(tl.float32), row, first, width, q_ptr, s_ptr, width, stride_sg, fp8_max,
                                   BLOCK, EMULATE_E4M3_CAST)

    @triton.jit
    def _silu_mul_packed_token_kernel(gu_ptr, out_ptr, q_ptr, s_ptr, stride_gu, width, fp8_max, BLOCK: tl.constexpr,
                                      ONE_PASS: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        """Program ``row``: the row of ``silu(gate) * up``, then its e4m3 values quantized per token
        (``--quantization w8a8_fp8``'s down projection) — ``fp8_channel.quantize_tokens`` of the output, without
        its launch. ``ONE_PASS`` (``BLOCK`` covers the row): the row is held whole, every load in flight at once.
        Otherwise ``BLOCK`` columns at a time: the first pass writes the output and takes its peak, the second
        recomputes each slice (the same bits; ``[gate | up]`` is in L2 by then) and quantizes it."""
        row = tl.program_id(0)
        gate_row = gu_ptr + row * stride_gu
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            inside = cols < width
            g = tl.load(gate_row + cols, mask=inside, other=0.0).to(tl.float32)
            u = tl.load(gate_row + width + cols, mask=inside, other=0.0).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * width + cols, y, mask=inside)
            peak = tl.max(tl.abs(y.to(tl.float32)), axis=0)
            q, scale = _quantize_token(y.to(tl.float32), peak, fp8_max, EMULATE_E4M3_CAST)
            tl.store(q_ptr + row * width + cols, q, mask=inside)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for first in range(0, width, BLOCK):
                cols = first + tl.arange(0, BLOCK)
                inside = cols < width
                g = tl.load(gate_row + cols, mask=inside, other=0.0).to(tl.float32)
                u = tl.load(gate_row + width + cols, mask=inside, other=0.0).to(tl.float32)
                y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + row * width + cols, y, mask=inside)
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
            peak = tl.max(amax, axis=0)
            for first in range(0, width, BLOCK):
                cols = first + tl.arange(0, BLOCK)
                inside = cols < width
                g = tl.load(gate_row + cols, mask=inside, other=0.0).to(tl.float32)
                u = tl.load(gate_row + width + cols, mask=inside, other=0.0).to(tl.float32)
                y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
                q, scale = _quantize_token(y.to(tl.float32), peak, fp8_max, EMULATE_E4M3_CAST)
                tl.store(q_ptr + row * width + cols, q, mask=inside)
        tl.store(s_ptr + row, tl.where(peak > 0, tl.div_rn(peak, fp8_max), 1.0))  # _quantize_token's scale

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, seq,
                     sx_b, sx_h, sx_s, scs_b, scs_s, so_b, so_h, so_s, HALF: tl.constexpr):
        # one program per (batch, head, position); x [B, H, S, 2*HALF] (last dim contiguous),
        # cos/sin [B, S, 2*HALF], out contiguous like x
        pid = tl.program_id(0)
        s = pid % seq
        h = (pid // seq) % heads
        b = pid // (seq * heads)
        d = tl.arange(0, HALF)
        x_row = x_ptr + b * sx_b + h * sx_h + s * sx_s
        x1 = tl.load(x_row + d).to(tl.float32)
        x2 = tl.load(x_row + HALF + d).to(tl.float32)
        cs_row = b * scs_b + s * scs_s
        cos1 = tl.load(cos_ptr + cs_row + d).to(tl.float32)
        cos2 = tl.load(cos_ptr + cs_row + HALF + d).to(tl.float32)
        sin1 = tl.load(sin_ptr + cs_row + d).to(tl.float32)
        sin2 = tl.load(sin_ptr + cs_row + HALF + d).to(tl.float32)
        out_row = out_ptr + b * so_b + h * so_h + s * so_s
        tl.store(out_row + d, (x1 * cos1 - x2 * sin1).to(out_ptr.dtype.element_ty))
        tl.store(out_row + HALF + d, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, seq, stride_t,
                             scs_b, scs_s, q_heads, kv_heads, eps,
                             keys_ptr, values_ptr, slots_ptr, positions_ptr,
                             sks_slot, sks_h, sks_pos, svs_slot, svs_h, svs_pos, k_inv_scale, v_inv_scale, limit,
                             rs_ptr, cs_ptr, HALF: tl.constexpr, NORM: tl.constexpr, WRITE_CACHE: tl.constexpr,
                             SATURATE: tl.constexpr, SCALED: tl.constexpr):
        # program (token t = b * seq + s, head h) of the fused q/k/v output [tokens, (Hq + 2 Hkv) * D]:
        # h < Hq is a query head, else key head h - Hq (the keys follow the queries in the row);
        # optional per-head RMSNorm (Qwen3's q_norm / k_norm), then the rotary embedding. WRITE_CACHE:
        # key head j stores its rotated key, and copies value head j, straight into the KV cache at
        # (slots[t], j, positions[t]) in the cache's dtype instead of into k_ptr (an FP8 cache, SATURATE:
        # clamp(x / scale, ±limit), as kv_cache.write_decode_kv stores it). SCALED: qkv is an unscaled FP8 product
        # (fp8_channel.unscaled_mm) whose token scales are at rs_ptr and column scales at cs_ptr; each value read is
        # first scaled and rounded to qkv's dtype, as fp8_channel.apply_scales does
        t = tl.program_id(0)
        h = tl.program_id(1)
        b = t // seq
        s = t % seq
        d = tl.arange(0, HALF)
        src = qkv_ptr + t * stride_t + h * (2 * HALF)
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + HALF + d).to(tl.float32)
        if SCALED:
            token_scale = tl.load(rs_ptr + t)
            x1 = (x1 * token_scale * tl.load(cs_ptr + h * (2 * HALF) + d)).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            x2 = (x2 * token_scale * tl.load(cs_ptr + h * (2 * HALF) + HALF + d)).to(qkv_ptr.dtype.element_ty)
            x2 = x2.to(tl.float32)
        if h < q_heads:
            w_ptr = qw_ptr
            out_row = q_ptr + (t * q_heads + h) * (2 * HALF)
        else:
            w_ptr = kw_ptr
            out_row = k_ptr + (t * kv_heads + h - q_heads) * (2 * HALF)
        if NORM:  # as the RMSNorm kernel: normalized, cast back to the activations' dtype, times the weight
            inverse = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
            w1 = tl.load(w_ptr + d).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
            x1 = (w1 * (x1 * inverse).to(qkv_ptr.dtype.element_ty).to(tl.float32)).to(q_ptr.dtype.element_ty)
            x2 = (w2 * (x2 * inverse).to(qkv_ptr.dtype.element_ty).to(tl.float32)).to(q_ptr.dtype.element_ty)
            x1 = x1.to(tl.float32)
            x2 = x2.to(tl.float32)
        cs_row = b * scs_b + s * scs_s
        cos1 = tl.load(cos_ptr + cs_row + d).to(tl.float32)
        cos2 = tl.load(cos_ptr + cs_row + HALF + d).to(tl.float32)
        sin1 = tl.load(sin_ptr + cs_row + d).to(tl.float32)
        sin2 = tl.load(sin_ptr + cs_row + HALF + d).to(tl.float32)
        r1 = (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty)
        r2 = (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty)
        if WRITE_CACHE and h >= q_heads:
            j = h - q_heads
            slot = tl.load(slots_ptr + t).to(tl.int64)
            position = tl.load(positions_ptr + t).to(tl.int64)
            key_row = keys_ptr + slot * sks_slot + j * sks_h + position * sks_pos
            value_src = qkv_ptr + t * stride_t + (q_heads + kv_heads + j) * (2 * HALF)
            k1 = r1.to(tl.float32)  # (exact: r1/r2 are already in the activations' dtype)
            k2 = r2.to(tl.float32)
            v1 = tl.load(value_src + d).to(tl.float32)
            v2 = tl.load(value_src + HALF + d).to(tl.float32)
            if SCALED:
                value_col = (q_heads + kv_heads + j) * (2 * HALF)
                v1 = (v1 * token_scale * tl.load(cs_ptr + value_col + d)).to(qkv_ptr.dtype.element_ty).to(tl.float32)
                v2 = (v2 * token_scale * tl.load(cs_ptr + value_col + HALF + d)).to(qkv_ptr.dtype.element_ty)
                v2 = v2.to(tl.float32)
            if SATURATE:
                k1 = tl.clamp(k1 * k_inv_scale, -limit, limit)
                k2 = tl.clamp(k2 * k_inv_scale, -limit, limit)
                v1 = tl.clamp(v1 * v_inv_scale, -limit, limit)
                v2 = tl.clamp(v2 * v_inv_scale, -limit, limit)
            tl.store(key_row + d, k1.to(keys_ptr.dtype.element_ty))
            tl.store(key_row + HALF + d, k2.to(keys_ptr.dtype.element_ty))
            value_row = values_ptr + slot * svs_slot + j * svs_h + position * svs_pos
            tl.store(value_row + d, v1.to(values_ptr.dtype.element_ty))
            tl.store(value_row + HALF + d, v2.to(values_ptr.dtype.element_ty))
        else:
            tl.store(out_row + d, r1)
            tl.store(out_row + HALF + d, r2)


QUANT_MODES = {False: 0, True: 1, "group": 1, "token": 2}  # a producer's quantize= -> its kernels' QUANT


def _quantized_outputs(rows: int, cols: int, block: int, out: torch.Tensor, quantize):
    """(e4m3 values ``[rows, cols]``, fp32 scales) for a producing kernel that handles ``block`` columns a
    program to fill: ``quantize`` True / "group" per 128-channel group (whole groups only; scales
    ``[ceil(cols/128), rows]``), "token" per token (the kernel holds the whole row; scales ``[rows, 1]``);
    else ``out`` twice: a valid pointer the kernel does not touch."""
    from slime.backends.embedded_engine.fp8.numerics import FP8_DTYPE

    if not quantize:
        return out, out
    if quantize == "token":
        if block < cols:
            raise ValueError(f"quantize='token': a program holds {block} of the row's {cols} channels")
        return (torch.empty((rows, cols), dtype=FP8_DTYPE, device=out.device),
                torch.empty((rows, 1), dtype=torch.float32, device=out.device))
    if cols % 128 or block % 128:
        raise ValueError(f"quantize: {cols} channels (a {block}-wide block) are not whole 128-channel groups")
    return (torch.empty((rows, cols), dtype=FP8_DTYPE, device=out.device),
            torch.empty((triton.cdiv(cols, 128), rows), dtype=torch.float32, device=out.device))


def _checked_scales(scales: tuple[torch.Tensor, torch.Tensor] | None, shape: tuple[int, int], unread: torch.Tensor):
    """An unscaled FP8 product's (token ``[M, 1]``, channel ``[N, 1]``) scales for a ``[M, N]`` input, checked (fp32,
    contiguous); without scales ``unread`` twice (any valid pointer: the kernel, compiled unscaled, never reads
    it), as ``_quantized_outputs`` does for a kernel that does not quantize."""
    if scales is None:
        return unread, unread
    token_scales, channel_scales = scales
    if token_scales.shape != (shape[0], 1) or channel_scales.shape != (shape[1], 1) \
            or token_scales.dtype != torch.float32 or channel_scales.dtype != torch.float32 \
            or not token_scales.is_contiguous() or not channel_scales.is_contiguous():
        raise ValueError(f"scales of an unscaled FP8 product [{shape[0]}, {shape[1]}]: contiguous fp32 [{shape[0]}, 1] "
                         f"and [{shape[1]}, 1] expected, got {tuple(token_scales.shape)} {token_scales.dtype} and "
                         f"{tuple(channel_scales.shape)} {channel_scales.dtype}")
    return token_scales, channel_scales


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool | str = False):
    """HF's RMSNorm in one kernel. ``quantize``: also the output's e4m3 activations for an FP8 GEMM,
    quantized per token and 128-channel group with ``fp8.quantize_activation``'s numbers (True / "group"),
    or per token with ``fp8_channel.quantize_rows``' ("token"); returns ``(out, (values [M, K], scales))``,
    the scales ``[M, K/128]`` group-major or ``[M, 1]``."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(shape[-1])
    values, scales = _quantized_outputs(rows.shape[0], shape[-1], block, out, quantize)
    _rmsnorm_kernel[(rows.shape[0],)](rows, weight, out, values, scales, rows.stride(0), out.stride(0),
                                      scales.stride(0) if quantize else 0, shape[-1], eps, FP8_MAX, BLOCK=block,
                                      QUANT=QUANT_MODES[quantize], EMULATE_E4M3_CAST=_interpreting(),
                                      num_warps=4 if shape[-1] <= 2048 else 8)
    if not quantize:
        return out.view(shape)
    return out.view(shape), (values, scales if quantize == "token" else scales.t())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 quantize: bool | str = False, x_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``h = x + residual`` and ``rmsnorm(h) * weight`` in one kernel; returns ``(normed, h)``, each as
    HF's ``residual + x`` followed by its RMSNorm module rounds them (``quantize``: and the e4m3
    activations of ``normed``, as :func:`rms_norm`: ``(normed, h, (values, scales))``). ``x_scales``: ``x`` is an
    unscaled FP8 product (``fp8_channel.ChannelFp8Linear.forward_unscaled``) with these (token ``[M, 1]``, channel
    ``[N, 1]``) scales, applied as the kernel loads it (``fp8_channel.apply_scales``' numbers)."""
    shape = x.shape
    rows, res = x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if res.stride(-1) != 1:
        res = res.contiguous()
    total = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, total.dtype), device=x.device)
    block = triton.next_power_of_2(shape[-1])
    values, scales = _quantized_outputs(rows.shape[0], shape[-1], block, out, quantize)
    token_scales, channel_scales = _checked_scales(x_scales, rows.shape, out)
    _add_rmsnorm_kernel[(rows.shape[0],)](rows, res, weight, out, total, values, scales, token_scales, channel_scales,
                                          rows.stride(0), res.stride(0), scales.stride(0) if quantize else 0,
                                          shape[-1], eps, FP8_MAX, BLOCK=block, QUANT=QUANT_MODES[quantize],
                                          SCALED_X=x_scales is not None, EMULATE_E4M3_CAST=_interpreting(),
                                          num_warps=4 if shape[-1] <= 2048 else 8)
    if quantize:
        return out.view(shape), total.view(shape), (values, scales if quantize == "token" else scales.t())
    return out.view(shape), total.view(shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, num_warps=4)
    return out


# the per-token quantizing SiLU gate holds a row of up to SILU_TOKEN_ONE_PASS columns whole (16 warps: 32 values
# a thread at 16384) and streams longer ones SILU_TOKEN_BLOCK columns at a time, twice: the slower way
# (docs/performance.md)
SILU_TOKEN_ONE_PASS = 16384
SILU_TOKEN_BLOCK = 1024


def silu_mul_packed(gate_up: torch.Tensor, quantize: bool | str = False):
    """``[..., 2·I]`` holding ``[gate | up]`` (the fused gate/up projection's output) -> ``silu(gate) * up``
    ``[..., I]``, read in place (no split copies). ``quantize``: also its e4m3 activations for the FP8
    down projection, as :func:`rms_norm`: ``(out, (values, scales))`` — per 128-channel group (True /
    "group") or per token ("token": one program a row, held whole up to ``SILU_TOKEN_ONE_PASS`` columns)."""
    shape = gate_up.shape
    width = shape[-1] // 2
    rows = gate_up.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if quantize == "token":
        values, scales = _quantized_outputs(rows.shape[0], width, width, out, quantize)
        if rows.shape[0]:
            whole = triton.next_power_of_2(width)
            one_pass = whole <= SILU_TOKEN_ONE_PASS
            _silu_mul_packed_token_kernel[(rows.shape[0],)](
                rows, out, values, scales, rows.stride(0), width, FP8_MAX,
                BLOCK=whole if one_pass else SILU_TOKEN_BLOCK, ONE_PASS=one_pass, EMULATE_E4M3_CAST=_interpreting(),
                num_warps=max(4, min(16, whole // 1024)) if one_pass else 4)
        return out.view(*shape[:-1], width), (values, scales)
    block = min(1024, triton.next_power_of_2(width))
    values, scales = _quantized_outputs(rows.shape[0], width, block, out, quantize)
    _silu_mul_packed_kernel[(rows.shape[0], triton.cdiv(width, block))](
        rows, out, values, scales, rows.stride(0), scales.stride(0) if quantize else 0, width, FP8_MAX, BLOCK=block,
        QUANT=QUANT_MODES[bool(quantize)], EMULATE_E4M3_CAST=_interpreting(), num_warps=4)
    out = out.view(*shape[:-1], width)
    return (out, (values, scales.t())) if quantize else out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, H, S, D]`` (any strides, last dim contiguous), ``cos/sin [B, S, D]`` -> rotated, ``[B, H, S, D]``."""
    batch, heads, seq, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.expand(batch, seq, dim).contiguous(), sin.expand(batch, seq, dim).contiguous()
    out = torch.empty((batch, seq, heads, dim), dtype=x.dtype, device=x.device).transpose(1, 2)  # HF's layout
    _rope_kernel[(batch * heads * seq,)](x, cos, sin, out, heads, seq, x.stride(0), x.stride(1), x.stride(2),
                                         cos.stride(0), cos.stride(1), out.stride(0), out.stride(1), out.stride(2),
                                         HALF=dim // 2, num_warps=1)
    return out


def qk_norm_rope(qkv: torch.Tensor, q_heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, cache_write=None, scales: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused q/k/v projection's output ``qkv [B, S, (Hq + 2·Hkv)·D]`` -> ``(query [B, Hq, S, D],
    key [B, Hkv, S, D])``: each head RMSNorm-ed with ``q_weight`` / ``k_weight`` when given (Qwen3),
    then rotated by ``cos/sin [B or 1, S, D]`` — one launch for what is otherwise two RMSNorm and two
    rotary kernels, and two copies (the RMSNorm wrapper's ``reshape`` of the strided q/k views).
    Results as :func:`rms_norm` then :func:`rotate` give them (same roundings, the norm's sum of
    squares added in two halves). The outputs have HF's layout (a transpose of ``[B, S, H, D]``).

    ``cache_write = (keys, values, slots, positions, k_scale, v_scale)`` (the cache buffers of the
    layer ``[slots, Hkv, capacity, D]``, per token ``t = b·S + s`` its slot and position, and the
    layer's FP8 scales): the rotated keys and the values go straight into the cache, in its dtype, as
    :func:`~slime.backends.embedded_engine.kv_cache.write_decode_kv` would store them — the decode
    step's separate cache-write launch saved — and ``key`` is returned as None.

    ``scales``: ``qkv`` is an unscaled FP8 product (``fp8_channel.ChannelFp8Linear.forward_unscaled``) with these
    (token ``[B·S, 1]``, channel ``[(Hq + 2·Hkv)·D, 1]``) scales, applied as the kernel loads it
    (``fp8_channel.apply_scales``' numbers). Without ``cache_write`` the caller still needs the values scaled."""
    batch, seq, width = qkv.shape
    dim = width // (q_heads + 2 * kv_heads)
    rows = qkv.reshape(batch * seq, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    norm = q_weight is not None
    query = torch.empty((batch, seq, q_heads, dim), dtype=qkv.dtype, device=qkv.device)
    if cache_write is None:
        key = torch.empty((batch, seq, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
        keys = values = slots = positions = rows
        cache_strides = (0,) * 6
        k_scale = v_scale = 1.0
    else:
        keys, values, slots, positions, k_scale, v_scale = cache_write
        if keys.stride(-1) != 1 or values.stride(-1) != 1 or slots.numel() != batch * seq \
                or positions.numel() != batch * seq or keys.shape[-1] != dim or values.shape[-1] != dim:
            raise ValueError(f"cache_write: cache rows [.., {keys.shape[-1]}] / [.., {values.shape[-1]}] (last dim "
                             f"contiguous) and {batch * seq} slots and positions expected for head dim {dim}")
        key = query  # unused by the kernel
        cache_strides = (keys.stride(0), keys.stride(1), keys.stride(2),
                         values.stride(0), values.stride(1), values.stride(2))
    token_scales, channel_scales = _checked_scales(scales, rows.shape, rows)
    _qk_norm_rope_kernel[(batch * seq, q_heads + kv_heads)](
        rows, q_weight if norm else rows, k_weight if norm else rows, cos, sin, query, key, seq, rows.stride(0),
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), q_heads, kv_heads, eps,
        keys, values, slots, positions, *cache_strides, 1.0 / k_scale, 1.0 / v_scale,
        torch.finfo(keys.dtype).max if keys.dtype.is_floating_point else 0.0, token_scales, channel_scales,
        HALF=dim // 2, NORM=norm, WRITE_CACHE=cache_write is not None,
        SATURATE=keys.dtype in FP8_DTYPES, SCALED=scales is not None, num_warps=1)
    return query.transpose(1, 2), (None if cache_write is not None else key.transpose(1, 2))


def _attention_norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None, scales=None):
    """Bound on a fused-projection attention module by :func:`install`: its q/k RMSNorm (if any) and
    rotary embedding as one kernel, or ``None`` where the kernel does not apply (the caller then runs
    the modules). Where ``cache`` offers a decode write target (``cache.fused_write_target``, the
    decode step's :class:`~slime.backends.embedded_engine.kv_cache.DecodeCacheView` on CUDA), the
    kernel also stores the layer's keys and values in the cache and the key comes back as None: the
    caller then reads the cache (``cache.read``) instead of calling ``cache.update``. ``scales``: ``qkv`` is an
    unscaled FP8 product with these scales (:func:`qk_norm_rope`)."""
    dim, sizes = self.head_dim, self.qkv_proj.sizes
    half = dim // 2
    if qkv.dim() != 3 or cos.dim() != 3 or cos.shape[-1] != dim or dim % 2 or half & (half - 1) or \
            cos.shape[0] not in (1, qkv.shape[0]):
        return None
    q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
    weights = (None, None) if q_norm is None else (q_norm.weight, k_norm.weight)
    if q_norm is not None and (q_norm.weight.dtype != qkv.dtype or k_norm.weight.dtype != qkv.dtype
                               or q_norm.variance_epsilon != k_norm.variance_epsilon):
        return None
    eps = q_norm.variance_epsilon if q_norm is not None else 0.0
    target = getattr(cache, "fused_write_target", None)
    cache_write = target(self.layer_idx) if KV_WRITE_IN_NORM_ROPE and target is not None else None
    if cache_write is not None and (sizes[1] != sizes[2] or cache_write[0].shape[-1] != dim
                                    or cache_write[1].shape[-1] != dim):
        cache_write = None
    return qk_norm_rope(qkv, sizes[0] // dim, sizes[1] // dim, cos, sin, *weights, eps=eps, cache_write=cache_write,
                        scales=scales)


_attention_norm_rope.takes_scales = True  # fused_projections' forward may hand it an unscaled FP8 product


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1, fallback=None):
    """Drop-in for the HF function of the same name, for the ``unsqueeze_dim=1`` layout with an even,
    power-of-two half head size; other calls go to ``fallback`` (the model family's own function,
    which :func:`install` binds)."""
    dim = q.shape[-1]
    if unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3 or dim % 2 or (dim // 2) & (dim // 2 - 1):
        if fallback is None:
            raise ValueError(f"fused rotary embedding supports [B, H, S, D] with a power-of-two D/2, got "
                             f"{tuple(q.shape)} (unsqueeze_dim={unsqueeze_dim})")
        return fallback(q, k, cos, sin, unsqueeze_dim)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def _rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _packed_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:  # gate/up fused (fused_projections.py)
    return self.down_proj(silu_mul_packed(self.gate_up_proj(x)))


def _small_m_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A decoder linear: the small-M Triton GEMM for decode-sized inputs (when switched on), else
    PyTorch's (cuBLAS)."""
    if small_gemm.ENABLED and x.numel() <= small_gemm.MAX_ROWS * x.shape[-1]:
        return small_gemm.linear(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _fp8_consumer(linear, rows: int, device: torch.device):
    """``linear`` when it is an FP8 linear (``fp8.Fp8Linear``, ``fp8_channel.ChannelFp8Linear``) whose GEMM of
    ``rows`` tokens takes its activations quantized by their producer (:data:`FP8_QUANT_IN_PRODUCER`), else
    None."""
    if not FP8_QUANT_IN_PRODUCER or not hasattr(linear, "takes_quantized"):
        return None
    return linear if linear.takes_quantized(rows, device) else None


def _deferring_output_projection(attention, rows: int, device: torch.device):
    """The attention's output projection when its product can reach the decoder layer's residual add + RMSNorm
    unscaled (``fp8_channel``'s ``cublas`` backend, :meth:`~fp8_channel.ChannelFp8Linear.defers_scales`): an
    attention whose forward is ``fused_projections``' (it returns that product as it is), else None."""
    from slime.backends.embedded_engine.kernels import fused_projections

    o_proj = getattr(attention, "o_proj", None)
    forward = getattr(getattr(attention.forward, "__func__", None), "func", None)
    if forward is not fused_projections._attention_forward or not hasattr(o_proj, "defers_scales"):
        return None
    return o_proj if o_proj.defers_scales(rows, device) else None


class _HandOff:
    """A decoder layer's MLP output on its way to the next layer, unscaled (:data:`DOWN_SCALES_TO_NEXT_LAYER`):
    ``(the residual the layer returned, the down projection's unscaled product, its (token, channel) scales)``,
    written by the first layer at every forward (None when it added its MLP output itself) and taken by the second,
    whose input RMSNorm adds them (:func:`link_layers` pairs them)."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending = None

    def take(self, hidden_states: torch.Tensor):
        """``(product, scales)`` to add to ``hidden_states`` before the layer's input norm, or None."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        residual, product, scales = pending
        if residual is not hidden_states:
            raise RuntimeError("fp8 cublas: a decoder layer's input is not the residual the previous layer returned "
                               "(something ran between them); the previous down projection's product cannot be added")
        return product, scales


def link_layers(model: torch.nn.Module) -> int:
    """Pair each two consecutive decoder layers on :func:`_decoder_layer_forward` of a model's ``layers`` (the
    first ``config.num_hidden_layers``: the ones its forward runs in order) whose second's input norm is an RMSNorm:
    the first may hand its MLP output to the second unscaled (:class:`_HandOff`). Returns the number of pairs."""
    pairs = 0
    for module in model.modules():
        layers, config = getattr(module, "layers", None), getattr(module, "config", None)
        if not isinstance(layers, torch.nn.ModuleList) or config is None:
            continue
        run = list(layers[: getattr(config, "num_hidden_layers", len(layers))])
        for first, second in zip(run, run[1:]):
            if _runs_fused_forward(first) and _runs_fused_forward(second) \
                    and type(getattr(second, "input_layernorm", None)).__name__ in RMSNORM_CLASSES:
                first._hand_off_out = second._hand_off_in = _HandOff()  # plain attributes (not submodules)
                pairs += 1
    return pairs


def _runs_fused_forward(layer: torch.nn.Module) -> bool:
    return getattr(layer.forward, "__func__", None) is _decoder_layer_forward


def _add_rms_norm_feeding(consumer, x: torch.Tensor, residual: torch.Tensor, norm, x_scales=None):
    """:func:`add_rms_norm` with ``norm``'s weight -> ``(normed, sum)``; where ``consumer`` (an FP8 linear from
    :func:`_fp8_consumer`) reads ``normed``, the kernel also writes its e4m3 activations and offers them to it."""
    if consumer is None:
        return add_rms_norm(x, residual, norm.weight, norm.variance_epsilon, x_scales=x_scales)
    normed, total, quantized = add_rms_norm(x, residual, norm.weight, norm.variance_epsilon,
                                            quantize=consumer.activation_scaling, x_scales=x_scales)
    consumer.offer(normed, quantized)
    return normed, total


def _decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """HF's decoder layer of these families (pre-norm attention, then pre-norm MLP, each added to the
    residual) with the first residual add and the post-attention RMSNorm as one kernel. Under FP8
    (``fp8.Fp8Linear`` projections on the two-kernel GEMM's token counts) the RMSNorms and the SiLU
    gate also write the e4m3 activations of the projection they feed (no quantize launch), and the
    MLP's residual add happens in the down projection's epilogue — or, under ``fp8_channel``'s ``cublas``
    backend, in the next layer's input RMSNorm, which also scales the unscaled product (:class:`_HandOff`)."""
    hand_out = getattr(self, "_hand_off_out", None)
    if hand_out is not None:
        hand_out.pending = None  # written at every forward: nothing from an earlier one reaches the next layer
    hand_in = getattr(self, "_hand_off_in", None)
    previous = None if hand_in is None else hand_in.take(hidden_states)
    residual = hidden_states
    tokens = hidden_states.numel() // hidden_states.shape[-1]
    device = hidden_states.device
    norm = self.input_layernorm
    qkv = _fp8_consumer(getattr(self.self_attn, "qkv_proj", None), tokens, device)
    if previous is not None:  # the previous layer's MLP output, unscaled: scaled and added to the residual here
        product, scales = previous
        attention_input, residual = _add_rms_norm_feeding(qkv, product, hidden_states, norm, x_scales=scales)
    elif qkv is not None and type(norm).__name__ in RMSNORM_CLASSES:
        attention_input, quantized = rms_norm(hidden_states, norm.weight, norm.variance_epsilon,
                                              quantize=qkv.activation_scaling)
        qkv.offer(attention_input, quantized)
    else:
        attention_input = norm(hidden_states)
    o_proj = _deferring_output_projection(self.self_attn, tokens, device)
    if o_proj is not None:
        o_proj.defer_scales_once()  # the add + RMSNorm below scales the output projection's product
    attended, _ = self.self_attn(hidden_states=attention_input, **kwargs)
    o_scales = None if o_proj is None else o_proj.take_scales(attended)
    norm = self.post_attention_layernorm
    mlp = self.mlp
    down = getattr(mlp, "down_proj", None)
    packed = getattr(mlp.forward, "__func__", None) is _packed_mlp_forward
    gate_up = _fp8_consumer(getattr(mlp, "gate_up_proj", None), tokens, device) if packed else None
    normed, residual = _add_rms_norm_feeding(gate_up, attended, residual, norm, x_scales=o_scales)
    fp8_down = _fp8_consumer(down, tokens, device) if packed else None
    if fp8_down is not None and residual.is_contiguous():
        act, quantized = silu_mul_packed(mlp.gate_up_proj(normed), quantize=fp8_down.activation_scaling)
        fp8_down.offer(act, quantized)
        if hand_out is not None and DOWN_SCALES_TO_NEXT_LAYER and getattr(fp8_down, "defers_scales", None) \
                and fp8_down.defers_scales(tokens, device):
            product, scales = fp8_down.forward_unscaled(act)
            hand_out.pending = (residual, product, scales)  # the next layer's input RMSNorm adds them
            return residual
        return fp8_down(act, accumulate_into=residual)  # the residual add in the GEMM's epilogue (or after it)
    if MLP_RESIDUAL_IN_GEMM and getattr(mlp.forward, "__func__", None) is _packed_mlp_forward \
            and type(down) is torch.nn.Linear \
            and down.bias is None and down.weight.dtype == residual.dtype:
        # the second residual add inside the down projection's GEMM (accumulating into the sum the
        # add+RMSNorm kernel just wrote, cuBLAS beta = 1): one kernel less a layer
        gate_up = mlp.gate_up_proj(normed)
        rows = residual.view(-1, residual.shape[-1])
        if small_gemm.ENABLED and rows.shape[0] <= small_gemm.MAX_ROWS:  # and the SiLU gate in its prologue
            small_gemm.linear(gate_up, down.weight, residual=rows, out=rows, gate=True)
            return residual
        act = silu_mul_packed(gate_up)
        return rows.addmm_(act.view(-1, act.shape[-1]), down.weight.t()).view(residual.shape)
    return residual + mlp(normed)


def install(model: torch.nn.Module) -> dict:
    """Swap the fused kernels into ``model`` (CUDA + Triton only); return how many of each were installed."""
    import importlib
    import types

    counts = {"rmsnorm": 0, "mlp": 0, "rope": 0, "add_rmsnorm": 0, "qk_norm_rope": 0, "small_m_linear": 0}
    if triton is None or next(model.parameters()).device.type != "cuda":
        return counts
    for module in model.modules():
        name = type(module).__name__
        if name in DECODER_LAYER_CLASSES:
            for linear in module.modules():
                if isinstance(linear, torch.nn.Linear) and type(linear).forward is torch.nn.Linear.forward \
                        and linear.weight.dtype in SMALL_M_DTYPES:  # plain or fused projections, not FP8 ones
                    linear.forward = types.MethodType(_small_m_linear_forward, linear)
                    counts["small_m_linear"] += 1
        if name in DECODER_LAYER_CLASSES and type(getattr(module, "post_attention_layernorm", None)).__name__ \
                in RMSNORM_CLASSES and all(hasattr(module, a) for a in ("self_attn", "input_layernorm", "mlp")):
            module.forward = types.MethodType(_decoder_layer_forward, module)
            counts["add_rmsnorm"] += 1
        if hasattr(module, "qkv_proj") and hasattr(module.qkv_proj, "sizes") and hasattr(module, "head_dim"):
            module.fused_norm_rope = types.MethodType(_attention_norm_rope, module)  # fused_projections' forward
            counts["qk_norm_rope"] += 1
        if name in RMSNORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rmsnorm_forward, module)
            counts["rmsnorm"] += 1
        elif name in MLP_CLASSES and getattr(getattr(module, "config", None), "hidden_act", None) in ("silu", "swish") \
                and hasattr(module, "down_proj"):
            if hasattr(module, "gate_up_proj"):
                module.forward = types.MethodType(_packed_mlp_forward, module)
            elif hasattr(module, "gate_proj") and hasattr(module, "up_proj"):
                module.forward = types.MethodType(_mlp_forward, module)
            else:
                continue
            counts["mlp"] += 1
    counts["layer_hand_offs"] = link_layers(model)
    family = type(model).__module__.rsplit(".", 1)[0].rsplit(".", 1)[-1]  # transformers.models.<family>.modeling_x
    if family in ROPE_MODULES:
        modeling = importlib.import_module(type(model).__module__)
        original = getattr(modeling, "apply_rotary_pos_emb", None)
        if original is not None:
            if getattr(original, "func", None) is not apply_rotary_pos_emb:  # not installed yet in this process
                # looked up at call time by the attention modules; the family's own function handles the rest
                modeling.apply_rotary_pos_emb = functools.partial(apply_rotary_pos_emb, fallback=original)
            counts["rope"] = 1
    logger.info("fused Triton ops installed: %s", counts)
    return counts

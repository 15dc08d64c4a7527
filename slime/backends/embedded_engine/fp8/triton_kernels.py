"""Triton kernels of the FP8 GEMM (``--fp8-gemm-backend triton``, and the quantizer of ``cublas``):
``C = A @ Bᵀ`` with block scales.

* ``A [M, K]`` (activations, any float dtype) is quantized per token and 128-channel group, exactly as
  ``fp8.quantize_activation`` does: ``s = amax / 448`` (1 for an all-zero group), ``e4m3(x / s)``.
  Fused (``A_QUANTIZED`` off; the path for few tokens): *inside* the GEMM — the K step of the kernel is
  128 = one group, so each step loads the A tile in its own dtype, takes the row amax, quantizes in
  registers and feeds the e4m3 tile to the dot; one launch, no e4m3 copy of the activations, but every
  column-tile program re-quantizes the same rows. Two-kernel (``A_QUANTIZED`` on): ``_quantize_activation_kernel``
  writes e4m3 A and its scales once (scales group-major, ``[ceil(K/128), M]``, the layout cuBLASLt's
  1 x 128 scaling also reads), then the GEMM loads them — its A and B tiles by TMA (host
  ``TensorDescriptor``s, :func:`tma_usable`, tiles from :func:`plan_tma_tiles`) where rows are 16-byte
  aligned on Hopper, else by pointers. Both quantize with ``_quantize_rows``.
* ``B [N, K]`` is the weight, quantized once per update in 128 x 128 blocks with scales
  ``b_scales [ceil(N/128), ceil(K/128)]`` (``fp8.quantize_weight``).
* ``_fp8_gemm_kernel``: program ``(pid_m, pid_n, pid_k)`` owns ``BLOCK_M`` rows, ``BLOCK_N`` output
  columns and the ``pid_k``-th of ``SPLIT_K`` slices of the K steps::

      acc += (e4m3(A_tile / s_a) @ B_tileᵀ  in fp32) * s_a[m] * s_b[n // 128]

  With ``SPLIT_K == 1`` it writes ``acc`` in the output dtype. With ``SPLIT_K > 1`` (decode-sized M,
  where a few wide tiles would leave most SMs idle; :func:`plan_tiles` chooses) each program writes
  its fp32 partial to a workspace (tile-major: a tile's partial is contiguous, so its addresses do not
  depend on the unspecialized M and load and store 16 bytes a thread) and bumps a per-tile counter; the
  program that arrives last sums the partials in split
  order (deterministic: the same bits whichever program is last), writes the output and resets the
  counter to 0, so the counters never need clearing (one launch, capturable in a CUDA graph).
  Ragged edges (M, N, K not multiples of the tiles) are masked loads of zeros, which add nothing.

The division ``x / s`` must round exactly like the reference's (``e4m3`` of a value one fp32 ulp off
can differ), but a correctly rounded fp32 division per element is a multi-instruction sequence around
the slow reciprocal unit, and it runs on every A element in every column-tile program. So each row's
``1 / s`` is computed once (correctly rounded) and each quotient is ``q = x · (1/s)`` plus one fma
correction step, ``q + fma(-q, s, x) · (1/s)`` (Markstein's correction; the residual ``x - q·s`` is exact
in an fma). Checked against ``x / s`` on 40 M random pairs over amax in [2⁻⁸⁰, 2⁶⁰]: 0 differences
(the uncorrected product differs in 0.7 %). It can be off by an ulp only where the residual underflows
(groups with amax below ~2⁻⁸⁰ ≈ 1e-24, far below any bf16 activation).

Launch on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set
before import; slow, for tests on tiny shapes). The interpreter's fp32 -> e4m3 cast rounds wrongly
(124.3 -> 64, ties away from zero), so under it the kernel first rounds the fp32 values onto the e4m3
grid with fp32 bit arithmetic (``_round_to_e4m3_grid``, which numpy evaluates exactly) and the cast
only re-encodes exact values; compiled kernels use the GPU's own cast. No host syncs.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from slime.backends.embedded_engine.fp8.numerics import BLOCK, FP8_DTYPE, FP8_MAX
from slime.backends.embedded_engine.tickets import Tickets

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dequantize path of block.py is used
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side tensor descriptors: the two-kernel GEMM uses pointer loads
    TensorDescriptor = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of ``device``: CUDA with Triton, or the CPU under the interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


if triton is not None:

    @triton.jit
    def _round_to_e4m3_grid(v):
        """fp32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32.
        Normal e4m3 (|v| >= 2^-6) keeps 3 of fp32's 23 mantissa bits (round the other 20 away in the
        integer bits); subnormal e4m3 is a multiple of 2^-9, which adding and removing 2^14 rounds to
        (fp32's spacing at 2^14 is 2^-9)."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        magnitude = tl.abs(v)
        subnormal = (magnitude + 16384.0) - 16384.0
        subnormal = tl.where(v < 0, -subnormal, subnormal)
        return tl.where(magnitude < 0.015625, subnormal, normal)

    @triton.jit
    def _round_to_e4m3_grid_kernel(x_ptr, y_ptr, n, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        tl.store(y_ptr + offs, _round_to_e4m3_grid(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)

    @triton.jit
    def _quantize_rows(x, fp8_max, EMULATE_E4M3_CAST: tl.constexpr):
        """``x [BLOCK_M, 128]`` fp32 -> (e4m3 values, fp32 scales ``[BLOCK_M]``), the numbers of
        ``fp8.quantize_activation`` (division as explained in the module docstring)."""
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.div_rn(amax, fp8_max), 1.0)
        inverse = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        q = x * inverse[:, None]
        q = tl.fma(tl.fma(-q, scale[:, None], x), inverse[:, None], q)
        # no clamp to +-448: |x| <= amax, so |q| exceeds 448 by at most an fp32 ulp, which rounds to 448
        if EMULATE_E4M3_CAST:
            q = _round_to_e4m3_grid(q)
        return q.to(tl.float8e4nv), scale

    @triton.jit
    def _quantize_store_groups(y, row, first_col, n_cols, q_ptr, s_ptr, stride_qm, stride_sg, fp8_max,
                               BLOCK: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        """Quantize ``y [BLOCK]`` (fp32: columns ``first_col ..`` of ``row``, ``first_col`` a multiple of 128)
        per 128-channel group with ``_quantize_rows`` — the numbers of ``quantize_activation`` — and store
        the e4m3 values at ``q_ptr + row · stride_qm + column`` and each group's scale group-major at
        ``s_ptr + group · stride_sg + row``: for the producing kernel (RMSNorm, SiLU gate) to hand the
        next FP8 GEMM its activations already quantized."""
        q, scale = _quantize_rows(tl.reshape(y, (BLOCK // 128, 128)), fp8_max, EMULATE_E4M3_CAST)
        cols = first_col + tl.arange(0, BLOCK)
        tl.store(q_ptr + row * stride_qm + cols, tl.reshape(q, (BLOCK,)), mask=cols < n_cols)
        groups = first_col // 128 + tl.arange(0, BLOCK // 128)
        tl.store(s_ptr + groups * stride_sg + row, scale, mask=groups * 128 < n_cols)

    @triton.jit(do_not_specialize=["M", "M_OUT", "stride_sk"])  # row counts vary per batch: one compile for all
    def _quantize_activation_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_qm, stride_sk, fp8_max,
                                    BLOCK_M: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        """Program ``(pid_m, kb)``: rows ``[pid_m · BLOCK_M, +BLOCK_M)`` of channel group ``kb`` -> e4m3
        ``q [M_OUT, K]`` and the group's scales at ``s_ptr + kb · stride_sk + row`` (the scales are stored
        group-major, ``[ceil(K/128), M_OUT]``). Rows ``M .. M_OUT`` (padding) read as zeros: q 0, scale 1."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        kb = tl.program_id(1)
        k = kb * 128 + tl.arange(0, 128)
        in_k = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=(offs_m < M)[:, None] & in_k[None, :],
                    other=0.0).to(tl.float32)
        q, scale = _quantize_rows(x, fp8_max, EMULATE_E4M3_CAST)
        out_rows = offs_m < M_OUT
        tl.store(q_ptr + offs_m[:, None] * stride_qm + k[None, :], q, mask=out_rows[:, None] & in_k[None, :])
        tl.store(s_ptr + kb * stride_sk + offs_m, scale, mask=out_rows)

    @triton.jit
    def _quantize_weight_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_we, stride_wn, stride_qe, stride_qn, stride_se,
                                stride_sn, fp8_max, CHUNK: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr):
        """Program ``(nb, kb, e)``: the 128 x 128 block ``(nb, kb)`` of matrix ``e`` (rows / columns past
        ``N`` / ``K`` read as zeros, as the torch version's zero padding) -> its e4m3 values and
        fp32 scale, the numbers of ``fp8._quantize_weight_torch``: ``s = amax / 448`` (1 for an all-zero block),
        ``e4m3(clamp(w / s, ±448))`` with ``w / s`` correctly rounded (torch divides by a tensor so).
        Two passes of ``CHUNK`` rows at a time (the amax, then the values; the second reads the block
        from cache): few registers a thread, so several programs share an SM."""
        nb = tl.program_id(0)
        kb = tl.program_id(1)
        e = tl.program_id(2).to(tl.int64)
        cols = kb * 128 + tl.arange(0, 128)
        in_k = (cols < K)[None, :]
        w_block = w_ptr + e * stride_we + cols[None, :]
        amax = tl.zeros([CHUNK, 128], dtype=tl.float32)
        for first in range(0, 128, CHUNK):
            rows = nb * 128 + first + tl.arange(0, CHUNK)
            w = tl.load(w_block + rows[:, None].to(tl.int64) * stride_wn, mask=(rows < N)[:, None] & in_k, other=0.0)
            amax = tl.maximum(amax, tl.abs(w.to(tl.float32)))
        amax_all = tl.max(tl.max(amax, axis=1), axis=0)
        scale = tl.where(amax_all > 0, tl.div_rn(amax_all, fp8_max), 1.0)
        divisor = tl.full([CHUNK, 128], 1.0, tl.float32) * scale
        for first in range(0, 128, CHUNK):
            rows = nb * 128 + first + tl.arange(0, CHUNK)
            mask = (rows < N)[:, None] & in_k
            w = tl.load(w_block + rows[:, None].to(tl.int64) * stride_wn, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(w, divisor), -fp8_max), fp8_max)
            if EMULATE_E4M3_CAST:
                q = _round_to_e4m3_grid(q)
            tl.store(q_ptr + e * stride_qe + rows[:, None].to(tl.int64) * stride_qn + cols[None, :],
                     q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + e * stride_se + nb * stride_sn + kb, scale)

    # the token count varies per batch (and so does the stride of the group-major activation scales, M):
    # not specialized on, one compile for every batch size
    @triton.jit(do_not_specialize=["M", "stride_ask"])
    def _fp8_gemm_kernel(a_ptr, a_desc, a_s_ptr, b_ptr, b_desc, b_s_ptr, c_ptr, partial_ptr, counter_ptr, M, N, K,
                         stride_am, stride_ask, stride_bn, stride_bsn, stride_cm, fp8_max,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCALE_BLOCK: tl.constexpr, SPLIT_K: tl.constexpr, A_QUANTIZED: tl.constexpr,
                         TMA: tl.constexpr, ACCUMULATE: tl.constexpr, EMULATE_E4M3_CAST: tl.constexpr,
                         PER_CHANNEL: tl.constexpr):
        # PER_CHANNEL (``fp8_channel``, ``--quantization w8a8_fp8``; needs A_QUANTIZED): one scale per token
        # (``a_s_ptr + m``) and per weight row (``b_s_ptr + n · stride_bsn``), applied once after the K loop,
        # so the loop is plain ``acc = dot(a, b, acc)``, which Hopper's wgmma keeps in flight across K steps
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < M
        in_n = offs_n < N
        k_steps = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_steps, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, k_steps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(first, last):
            k = kb * BLOCK_K + offs_k
            in_k = k < K
            if TMA:  # two-kernel path, tiles by the tensor memory accelerator (out-of-bounds elements read 0)
                a_q = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
                if not PER_CHANNEL:
                    a_scale = tl.load(a_s_ptr + kb * stride_ask + offs_m, mask=in_m, other=0.0)
                b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
            else:
                if A_QUANTIZED:  # two-kernel path: e4m3 A and its group-major scales, from _quantize_activation_kernel
                    a_q = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :],
                                  mask=in_m[:, None] & in_k[None, :], other=0.0)
                    if not PER_CHANNEL:
                        a_scale = tl.load(a_s_ptr + kb * stride_ask + offs_m, mask=in_m, other=0.0)
                else:  # fused path: quantize this A tile in registers (again in every column-tile program)
                    a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=in_m[:, None] & in_k[None, :],
                                other=0.0).to(tl.float32)
                    a_q, a_scale = _quantize_rows(a, fp8_max, EMULATE_E4M3_CAST)
                b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None], mask=in_k[:, None] & in_n[None, :],
                            other=0.0)
            if PER_CHANNEL:
                acc = tl.dot(a_q, b, acc)
            elif BLOCK_N <= SCALE_BLOCK:  # the tile lies in one row of weight blocks: one weight scale per K step
                scale = a_scale * tl.load(b_s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn + kb)
                acc = tl.fma(tl.dot(a_q, b), scale[:, None], acc)
            else:
                b_scale = tl.load(b_s_ptr + (offs_n // SCALE_BLOCK) * stride_bsn + kb, mask=in_n, other=0.0)
                acc += tl.dot(a_q, b) * a_scale[:, None] * b_scale[None, :]
        if PER_CHANNEL:  # each split scales its own partial (the scales are linear in it)
            a_scale = tl.load(a_s_ptr + offs_m, mask=in_m, other=0.0)
            b_scale = tl.load(b_s_ptr + offs_n * stride_bsn, mask=in_n, other=0.0)
            acc = acc * a_scale[:, None] * b_scale[None, :]
        out_mask = in_m[:, None] & in_n[None, :]
        if SPLIT_K == 1:
            if ACCUMULATE:  # C += A @ Bᵀ: the sum in fp32, rounded once (a residual add in the epilogue)
                acc += tl.load(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], mask=out_mask,
                               other=0.0).to(tl.float32)
            tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=out_mask)
        else:
            # partial_ptr: fp32 [SPLIT_K, tiles, BLOCK_M · BLOCK_N], each tile's partial contiguous (offsets that do
            # not depend on the unspecialized M: 16-byte stores and loads); counter_ptr: one int32 a tile, 0 on entry
            tile = pid_m * tl.num_programs(1) + pid_n
            tiles = tl.num_programs(0) * tl.num_programs(1)
            tile_offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(partial_ptr + (pid_k * tiles + tile) * (BLOCK_M * BLOCK_N) + tile_offsets, acc)
            tl.debug_barrier()  # every thread's partial is written before this program signals it (release)
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last of the tile's programs: the others' partials are visible
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for split in tl.static_range(SPLIT_K):  # unrolled: all partial loads in flight at once
                    total += tl.load(partial_ptr + (split * tiles + tile) * (BLOCK_M * BLOCK_N) + tile_offsets,
                                     cache_modifier=".cg")
                if ACCUMULATE:
                    total += tl.load(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], mask=out_mask,
                                     other=0.0).to(tl.float32)
                tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], total.to(c_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.atomic_xchg(counter_ptr + tile, 0)

    @triton.jit
    def _round_to_bf16_grid(v, EMULATE: tl.constexpr):
        """fp32 ``v`` rounded to the nearest bf16 value (ties to even), still fp32, where the cast that
        follows would not round so (Triton's interpreter truncates); else ``v``."""
        if EMULATE:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
        return v

    @triton.jit(do_not_specialize=["M"])
    def _weight_only_gemm_kernel(x_ptr, w_ptr, w_s_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K,
                                 stride_xm, stride_wn, stride_wsn, stride_om,
                                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                 SCALE_BLOCK: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
                                 UPCAST: tl.constexpr, ROUND_BF16: tl.constexpr):
        """Weight-only FP8 (W8A16): ``out [M, N] = x @ dequant(W)ᵀ`` with ``x`` in its own dtype. The
        product is computed transposed, ``accᵀ [BLOCK_N, BLOCK_M] = W_tile @ x_tileᵀ`` ("swap AB"): the
        weight rows are the tensor cores' M side (64 a warp group), so a decode batch of 16-128 tokens
        is their N side, and the dequantized weight tile, made in registers, is the operand Hopper's
        wgmma may take from registers. Program ``(pid_m, pid_n, pid_k)``: ``BLOCK_M`` tokens,
        ``BLOCK_N`` weight rows, the ``pid_k``-th of ``SPLIT_K`` slices of the K steps; split-K
        partials are summed by the last program of a tile, as in ``_fp8_gemm_kernel``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        in_n = offs_n < N
        in_m = offs_m < M
        k_steps = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_steps, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, k_steps)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kb in range(first, last):
            k = kb * BLOCK_K + offs_k
            in_k = k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=in_n[:, None] & in_k[None, :],
                        other=0.0)
            w_scale = tl.load(w_s_ptr + (offs_n // SCALE_BLOCK) * stride_wsn + (kb * BLOCK_K) // SCALE_BLOCK,
                              mask=in_n, other=0.0)
            # dequantized exactly as fp8.dequantize_weight(values, scales, dtype): the fp32 product, rounded once
            w = _round_to_bf16_grid(w.to(tl.float32) * w_scale[:, None], ROUND_BF16).to(x_ptr.dtype.element_ty)
            x = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None], mask=in_k[:, None] & in_m[None, :],
                        other=0.0)
            if UPCAST:  # Triton's interpreter multiplies 16-bit floats wrongly; 16-bit products are exact in fp32
                acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc, input_precision=PRECISION)
        out_mask = in_n[:, None] & in_m[None, :]
        out_offsets = offs_m[None, :] * stride_om + offs_n[:, None]
        if SPLIT_K == 1:
            tl.store(out_ptr + out_offsets, _round_to_bf16_grid(acc, ROUND_BF16).to(out_ptr.dtype.element_ty),
                     mask=out_mask)
        else:
            # partial_ptr: fp32 [SPLIT_K, tiles, BLOCK_N · BLOCK_M], as in _fp8_gemm_kernel; counter_ptr: one int32 a tile
            tile = pid_n * tl.num_programs(0) + pid_m
            tiles = tl.num_programs(0) * tl.num_programs(1)
            tile_offsets = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            tl.store(partial_ptr + (pid_k * tiles + tile) * (BLOCK_N * BLOCK_M) + tile_offsets, acc)
            tl.debug_barrier()  # every thread's partial is written before this program signals it (release)
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last of the tile's programs: the others' partials are visible
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for split in tl.static_range(SPLIT_K):  # in split order: the sum does not depend on who came last
                    total += tl.load(partial_ptr + (split * tiles + tile) * (BLOCK_N * BLOCK_M) + tile_offsets,
                                     cache_modifier=".cg")
                tl.store(out_ptr + out_offsets, _round_to_bf16_grid(total, ROUND_BF16).to(out_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.atomic_xchg(counter_ptr + tile, 0)


def round_to_e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (|x| <= 448) rounded onto the e4m3 grid by the kernel's interpreter-side rounding
    (what its test compares with torch's cast)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _round_to_e4m3_grid_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK_SIZE=1024)
    return out


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One launch configuration of :func:`w8a8_block_matmul`."""

    block_m: int  # rows per program (16..128; >= 64 for Hopper's fp8 wgmma, smaller ones use mma.sync)
    block_n: int  # output columns per program (16..256; weight scales are read per column, so any width)
    split_k: int = 1  # programs sharing one output tile, each over a contiguous slice of the K steps
    num_warps: int = 4
    num_stages: int = 3


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# A cycle model of one launch on an H100/H200-class GPU, for choosing tiles. The ALU constants come from
# the kernel's sm_90 SASS (compiled here without a GPU): one K step of a 128 x 128 tile with 8 warps is
# ~1000 instructions a thread, ~2000 SM cycles, mostly quantizing the 128 x 128 A tile (bf16 unpack,
# amax, the corrected division, the e4m3 cast: ~12 instructions per A element) - and every column tile
# does it again for the same rows. Not timed: ``bench/fp8_gemm.py --sweep`` measures every candidate.
QUANT_INSTRUCTIONS_PER_A_ELEMENT = 12
STEP_OVERHEAD_CYCLES = 150  # loop, addresses, barriers, dot issue
HBM_BYTES_PER_CYCLE = 4.8e12 / 1.98e9  # the whole GPU (H200 HBM3e spec at the boost clock)
SM_BYTES_PER_CYCLE = 64  # what one SM can pull from L2/HBM
L2_LATENCY_CYCLES = 800
LAUNCH_CYCLES = 2000


def estimated_cycles(tiles: Tiles, rows: int, out_features: int, in_features: int, sms: int,
                     a_quantized: bool = False) -> float:
    """Estimated GPU cycles of one launch with ``tiles``: the ALU work (serialized per SM) or the bytes
    (the GPU's bandwidth, or one SM's when there are few programs), whichever is longer, plus the
    split-K reduction by one program per tile (see the constants above). ``a_quantized``: the
    two-kernel GEMM, which loads e4m3 A (and its scales) instead of quantizing it (the separate
    quantization kernel is not counted)."""
    steps = triton.cdiv(triton.cdiv(in_features, BLOCK), tiles.split_k)
    programs = _programs(tiles, rows, out_features)
    waves = triton.cdiv(programs, sms)
    quant = 0 if a_quantized else tiles.block_m * BLOCK * QUANT_INSTRUCTIONS_PER_A_ELEMENT
    alu = (quant + tiles.block_m * tiles.block_n) / 128
    step_bytes = tiles.block_n * BLOCK  # the weight tile of one K step (the A tile comes from L2)
    # HBM reads the weight once (row tiles of one column tile run side by side, and every Qwen3 linear's
    # fp8 weight fits the 50 MB L2); each SM still pulls its tiles at its own rate
    memory = max(out_features * in_features / HBM_BYTES_PER_CYCLE, waves * steps * step_bytes / SM_BYTES_PER_CYCLE)
    cycles = LAUNCH_CYCLES + max(waves * steps * alu, memory) + waves * steps * STEP_OVERHEAD_CYCLES
    if tiles.split_k > 1:  # the last program of a tile reads every split's fp32 partial tile
        cycles += tiles.split_k * tiles.block_m * tiles.block_n * 4 / SM_BYTES_PER_CYCLE + L2_LATENCY_CYCLES
    return cycles


def _programs(tiles: Tiles, rows: int, out_features: int) -> int:
    return triton.cdiv(rows, tiles.block_m) * triton.cdiv(out_features, tiles.block_n) * tiles.split_k


def candidate_tiles(rows: int, in_features: int) -> list[Tiles]:
    """The launches :func:`plan_tiles` chooses from: up to 64 rows one row tile (a decode step reads
    each weight byte once), more rows in tiles of 64 or 128; 32..256 columns (not 256 with 128 rows:
    the accumulator spills); K split 1, 2, 3, 4, 6 or 8 ways with at least two K steps a split; 8 warps from
    64 x 128 up (with 4 the fp32 A tile and the accumulator run out of registers)."""
    row_tiles = (max(16, triton.next_power_of_2(rows)),) if rows <= 64 else (64, 128)
    k_steps = triton.cdiv(in_features, BLOCK)
    return [Tiles(block_m, block_n, split, num_warps=8 if block_m >= 128 or block_m * block_n >= 64 * 128 else 4)
            for block_m in row_tiles
            for block_n in (32, 64, 128, 256) if not (block_m >= 128 and block_n > 128)
            for split in (1, 2, 3, 4, 6, 8) if split == 1 or k_steps >= 2 * split]


def plan_tiles(rows: int, out_features: int, in_features: int, device: torch.device,
               a_quantized: bool = False) -> Tiles:
    """The launch for an ``[rows, in_features] x [out_features, in_features]ᵀ`` GEMM. Decode shapes
    give few 128-wide tiles, so the SMs are filled (>= 7/8 of them get a program, where any candidate
    can) by splitting K (fp32 partials, summed by one program per tile) or by narrower column tiles
    (each re-quantizes the same A rows: ALU grows as 1 / BLOCK_N); among the launches that fill the
    GPU, the one with the fewest :func:`estimated_cycles` (``a_quantized``: of the two-kernel GEMM)."""
    return _planned_tiles(rows, out_features, in_features, _sm_count(device), a_quantized)


@functools.lru_cache(maxsize=4096)  # on the hot path of every eager forward: plan each shape once
def _planned_tiles(rows: int, out_features: int, in_features: int, sms: int, a_quantized: bool) -> Tiles:
    candidates = candidate_tiles(rows, in_features)
    enough = min(sms - sms // 8, max(_programs(tiles, rows, out_features) for tiles in candidates))
    whole = [tiles for tiles in candidates if tiles.split_k == 1 and _programs(tiles, rows, out_features) >= enough]
    if rows > 512 and whole:  # prefill with tiles enough: splitting would only add partials to write and read
        candidates = whole
    return min((tiles for tiles in candidates if _programs(tiles, rows, out_features) >= enough),
               key=lambda tiles: estimated_cycles(tiles, rows, out_features, in_features, sms, a_quantized))


# the two-kernel GEMM loads its tiles by TMA where it can: pointer loads wait on each K step's dot
# (docs/performance.md); False: pointer loads everywhere (bench/fp8_gemm.py compares the two)
USE_TMA = True


def tma_usable(a: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the two-kernel GEMM can load e4m3 ``a [M, K]`` and ``weight [N, K]`` by TMA: a Triton with
    tensor descriptors, a Hopper-or-newer GPU (or the interpreter), row strides and base addresses
    16-byte aligned (TMA's rule), unit column strides."""
    if TensorDescriptor is None or not USE_TMA:
        return False
    if a.device.type == "cuda":
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index)[0] < 9:
            return False
    elif not _interpreting():
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, weight))


TMA_DECODE_MAX_ROWS = 128  # plan_tma_tiles: <= 20 K steps a program up to here
TMA_MID_MAX_ROWS = 256  # <= 40 K steps up to here (same column and split rule); 128 columns above


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_tma_tiles(rows: int, out_features: int, in_features: int, device: torch.device) -> Tiles:
    """The launch of the two-kernel GEMM with TMA loads: a rule fitted to H200 sweeps of every
    candidate launch (``bench/fp8_gemm.py --sweep two_kernel``; :func:`tma_candidates`). Always 4
    warps and 64 rows (16 up to 16 tokens: few launch variants, fewer compiles, :func:`launch_key`).
    Up to 256 tokens: 64 output columns unless 128-column tiles alone give >= 0.7 programs an SM (the MLP's
    gate/up on 1.7B/4B), then K split 1, 2, 4 or 8 ways, the fewest giving >= a quarter as many programs as SMs
    with <= 20 K steps each (<= 40 from 129 tokens); 5 pipeline stages without a split, else 4. Above 256 tokens:
    128 columns, the fewest split giving >= half as many programs as SMs with <= 40 K steps. With 128 columns 4
    stages while <= 2 programs share an SM, else 3. A split needs >= 2 K steps each. How close the rule comes to
    the sweeps' best launches: docs/embedded_engine.md (block-wise GEMM, two-kernel Triton)."""
    return _planned_tma_tiles(rows, out_features, in_features, _sm_count(device) if device.type == "cuda" else 132)


@functools.lru_cache(maxsize=4096)
def _planned_tma_tiles(rows: int, out_features: int, in_features: int, sms: int) -> Tiles:
    block_m = 16 if rows <= 16 else 64  # above 16 tokens Hopper's fp8 wgmma (64 rows); few launch variants
    row_tiles = _cdiv(rows, block_m)
    k_steps = _cdiv(in_features, BLOCK)
    if rows <= TMA_MID_MAX_ROWS:
        block_n = 128 if row_tiles * _cdiv(out_features, 128) >= 0.7 * sms else 64
        min_programs, max_steps = sms // 4, (20 if rows <= TMA_DECODE_MAX_ROWS else 40)
    else:
        block_n, min_programs, max_steps = 128, sms // 2, 40
    tiles = row_tiles * _cdiv(out_features, block_n)
    split = 1
    for candidate in (1, 2, 4, 8):
        if candidate > 1 and k_steps < 2 * candidate:
            break
        split = candidate
        if tiles * candidate >= min_programs and _cdiv(k_steps, candidate) <= max_steps:
            break
    if block_n == 64:  # 16 KiB a stage: five fit twice in an SM's shared memory
        stages = 5 if split == 1 else 4
    else:
        stages = 4 if tiles * split <= 2 * sms else 3
    return Tiles(block_m, block_n, split, num_warps=4, num_stages=stages)


def tma_candidates(rows: int, in_features: int) -> list[Tiles]:
    """The launches ``bench/fp8_gemm.py --sweep two_kernel`` times against :func:`plan_tma_tiles`."""
    block_ms = sorted({16 if rows <= 16 else 64, 64})
    k_steps = triton.cdiv(in_features, BLOCK)
    return [Tiles(block_m, block_n, split, num_warps=4, num_stages=stages)
            for block_m in block_ms for block_n in (64, 128)
            for split in (1, 2, 4, 8) if split == 1 or k_steps >= 2 * split
            for stages in (3, 4, 5)]


_split_counters = Tickets("fp8 GEMM split-K counters")


QUANTIZE_BLOCK_M = 16  # rows per program of the activation quantizer (one 128-channel group each)


def quantize_activation(x: torch.Tensor, row_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M', K]``, fp32 scales ``[M', ceil(K/128)]``) in one launch, with ``M'`` =
    ``M`` rounded up to ``row_align`` (padding rows: values 0, scale 1). The numbers of
    ``fp8.quantize_activation`` (the same ``_quantize_rows`` as the fused GEMM). The scales are stored
    group-major — the returned ``[M', groups]`` tensor has strides ``(1, M')`` — which is the layout
    cuBLASLt's 1 x 128 block scaling reads ("outer-dim-major") and what the two-kernel GEMM loads
    per row tile. No host syncs."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    padded = -(-rows // row_align) * row_align
    groups = triton.cdiv(cols, BLOCK)
    values = torch.empty((padded, cols), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((groups, padded), dtype=torch.float32, device=x.device)
    if padded:
        _quantize_activation_kernel[(triton.cdiv(padded, QUANTIZE_BLOCK_M), groups)](
            x, values, scales, rows, padded, cols, x.stride(0), values.stride(0), scales.stride(0), FP8_MAX,
            BLOCK_M=QUANTIZE_BLOCK_M, EMULATE_E4M3_CAST=_interpreting(), num_warps=4)
    return values, scales.t()


WEIGHT_QUANTIZE_WARPS = 4
WEIGHT_QUANTIZE_CHUNK = 32  # rows of the block a pass holds: 32 fp32 values a thread


def quantize_weight_into(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """``fp8._quantize_weight_torch(weight)`` written into existing storage — e4m3 ``values [..., N, K]`` and fp32
    ``scales [..., ceil(N/128), ceil(K/128)]`` (views with unit last stride: a fused projection's rows,
    one expert) — by one launch, one program a 128 x 128 block: reads ``weight`` (any float dtype, any
    row stride) once and writes each value once, where the torch version makes three fp32 copies of the
    matrix (an FP8 weight update's cost). Same numbers: bit-exact under the interpreter
    (``test_gpu_weight_quantizer_is_bit_exact`` checks the compiled kernel on a GPU)."""
    *lead, rows, cols = weight.shape
    if len(lead) > 1:
        raise ValueError(f"fp8 weight quantization: a matrix or a stack of experts, got {tuple(weight.shape)}")
    if tuple(values.shape) != tuple(weight.shape) or tuple(scales.shape) != (*lead, triton.cdiv(rows, BLOCK),
                                                                          triton.cdiv(cols, BLOCK)):
        raise ValueError(f"fp8 weight quantization: storage {tuple(values.shape)} / {tuple(scales.shape)} does not "
                         f"fit a {tuple(weight.shape)} weight")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if values.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("fp8 weight quantization: the storage's last dimension must be contiguous")
    if weight.numel() == 0:
        return
    weight3, values3, scales3 = (t if lead else t.unsqueeze(0) for t in (weight, values, scales))
    _quantize_weight_kernel[(triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK), weight3.shape[0])](
        weight3, values3, scales3, rows, cols, weight3.stride(0), weight3.stride(1), values3.stride(0),
        values3.stride(1), scales3.stride(0), scales3.stride(1), FP8_MAX, CHUNK=WEIGHT_QUANTIZE_CHUNK,
        EMULATE_E4M3_CAST=_interpreting(), num_warps=WEIGHT_QUANTIZE_WARPS)


def launch_key(path: str, rows: int, out_features: int, in_features: int, device: torch.device,
               tma: bool) -> tuple:
    """What decides which compiled kernel a GEMM of ``path`` (``fused`` / ``two_kernel`` / ``weight_only``)
    on ``rows`` tokens launches: its tiles (and for the two-kernel GEMM whether it loads by TMA, given
    as ``tma``); the token count itself is not specialized on (``do_not_specialize``). GEMMs with
    equal keys share one compile (``fp8.warm_up`` compiles each key once)."""
    if path == "weight_only":
        return path, plan_weight_only(rows, out_features, in_features, device)
    if path == "two_kernel" and tma:
        return path, True, plan_tma_tiles(rows, out_features, in_features, device)
    return path, False, plan_tiles(rows, out_features, in_features, device, a_quantized=path == "two_kernel")


def tma_usable_for(weight: torch.Tensor) -> bool:
    """:func:`tma_usable` of the two-kernel GEMM on ``weight``: its quantized activations (a fresh
    ``[M, K]`` e4m3 tensor) are aligned when ``K`` is a multiple of 16."""
    probe = torch.empty((1, weight.shape[1]), dtype=FP8_DTYPE, device=weight.device)
    return tma_usable(probe, weight)


def w8a8_block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                      out_dtype: torch.dtype, tiles: Tiles | None = None, quantize_first: bool = False,
                      quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                      accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (any float dtype) times the block-quantized ``weight [N, K]`` transposed -> ``[M, N]``
    in ``out_dtype``. The activations are quantized per token and 128 channels inside the GEMM (the
    fused kernel) or, with ``quantize_first``, once by :func:`quantize_activation` before it (the
    two-kernel path: each column tile then loads e4m3 A instead of re-quantizing it). ``quantized``:
    ``x``'s e4m3 values and group-major scales, already made by the kernel that produced ``x`` (an
    RMSNorm or SiLU gate of ``fused_ops``, the numbers of :func:`quantize_activation`): the two-kernel
    GEMM without its quantize launch. ``accumulate_into``: an ``[M, N]`` tensor of ``out_dtype`` the
    product is added to in place (in fp32, rounded once: a residual add in the epilogue) and returned.
    ``tiles`` overrides :func:`plan_tiles` (tests, ``bench/fp8_gemm.py --sweep``)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != cols:
        raise ValueError(f"fp8 GEMM: activations have {cols} channels, the weight {weight.shape[1]}")
    out = output_for(rows, out_features, out_dtype, x.device, accumulate_into)
    if rows == 0:
        return out
    if quantized is not None or quantize_first:
        quantize_first = True
        a, a_scales = quantized if quantized is not None else quantize_activation(x)
        a_scale_stride = a_scales.stride(1)
        tma = tma_usable(a, weight)
    else:
        a, a_scales, a_scale_stride, tma = x, x, 0, False  # a_scales not read by the fused kernel
    if tiles is None:
        tiles = (plan_tma_tiles(rows, out_features, cols, x.device) if tma
                 else plan_tiles(rows, out_features, cols, x.device, a_quantized=quantize_first))
    launch_gemm(a, a_scales, a_scale_stride, weight, weight_scales, out, tiles, a_quantized=quantize_first, tma=tma,
                accumulate=accumulate_into is not None)
    return out


def output_for(rows: int, out_features: int, out_dtype: torch.dtype, device: torch.device,
               accumulate_into: torch.Tensor | None) -> torch.Tensor:
    """The ``[rows, out_features]`` tensor a GEMM writes: ``accumulate_into`` (checked: row-major, that shape
    and dtype; the product is added to it) or a new one."""
    if accumulate_into is None:
        return torch.empty((rows, out_features), dtype=out_dtype, device=device)
    if accumulate_into.shape != (rows, out_features) or accumulate_into.dtype != out_dtype \
            or accumulate_into.stride(1) != 1:
        raise ValueError(f"fp8 GEMM: accumulate_into must be a row-major [{rows}, {out_features}] {out_dtype} "
                         f"tensor, got {tuple(accumulate_into.shape)} {accumulate_into.dtype}")
    return accumulate_into


def launch_gemm(a: torch.Tensor, a_scales: torch.Tensor, a_scale_stride: int, weight: torch.Tensor,
                weight_scales: torch.Tensor, out: torch.Tensor, tiles: Tiles, a_quantized: bool, tma: bool,
                accumulate: bool, per_channel: bool = False) -> None:
    """One launch of ``_fp8_gemm_kernel`` writing ``out [M, N]`` (added to it with ``accumulate``): ``a [M, K]``
    in its own dtype (the fused path) or e4m3 (``a_quantized``) with group-major scales (``a_scale_stride``
    between groups) or, ``per_channel``, one scale a token (``a_scales [M, 1]``) and one a weight row
    (``weight_scales [N, 1]``: ``fp8_channel``); ``tma``: tiles loaded by TMA (:func:`tma_usable`)."""
    rows, cols = a.shape[0], weight.shape[1]
    out_features = weight.shape[0]
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n), tiles.split_k)
    # fetched on every call, so the first (eager) GEMM on a device allocates them: a CUDA graph captured
    # later (e.g. the dense MoE path, whose shapes the warm-up may not have run) finds them there
    counters = _split_counters.get(a.device, grid[0] * grid[1] if tiles.split_k > 1 else 1)
    if tiles.split_k > 1:
        partials = torch.empty((tiles.split_k, grid[0] * grid[1], tiles.block_m * tiles.block_n),
                               dtype=torch.float32, device=a.device)
    else:
        partials = out  # not read: the SPLIT_K == 1 kernel has no reduction
    a_desc = TensorDescriptor.from_tensor(a, [tiles.block_m, BLOCK]) if tma else a  # else: not read
    b_desc = TensorDescriptor.from_tensor(weight, [tiles.block_n, BLOCK]) if tma else weight
    _fp8_gemm_kernel[grid](a, a_desc, a_scales, weight, b_desc, weight_scales, out, partials, counters, rows,
                           out_features, cols,
                           a.stride(0), a_scale_stride, weight.stride(0), weight_scales.stride(0), out.stride(0),
                           FP8_MAX, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK, SCALE_BLOCK=BLOCK,
                           SPLIT_K=tiles.split_k, A_QUANTIZED=a_quantized, TMA=tma, ACCUMULATE=accumulate,
                           EMULATE_E4M3_CAST=_interpreting(), PER_CHANNEL=per_channel,
                           num_warps=tiles.num_warps, num_stages=tiles.num_stages)


# ---------------------------------------------------------------------------------------- weight-only (W8A16)
@dataclasses.dataclass(frozen=True)
class WeightOnlyTiles:
    """One launch configuration of :func:`weight_only_matmul`."""

    block_m: int  # tokens per program (16..128: the tensor cores' N side)
    block_n: int  # weight rows per program (64 or 128: one or two wgmma row groups)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


H200_FLOPS_PER_SM_CYCLE = 989e12 / 1.98e9 / 132  # dense bf16 tensor-core FLOPs of one SM a cycle (spec)
CONVERT_INSTRUCTIONS_PER_W_ELEMENT = 3  # e4m3 -> fp32, times the scale, -> bf16 (per weight element, per program)
MEMORY_LATENCY_CYCLES = 1000  # an HBM load's round trip: a program with few tiles in flight waits on it


def weight_only_candidates(rows: int, in_features: int) -> list[WeightOnlyTiles]:
    """The launches :func:`plan_weight_only` chooses from: one token tile up to 128 tokens (so each
    weight element is read and dequantized once), 128-token tiles above; 64 or 128 weight rows; K split
    1, 2, 3, 4, 6 or 8 ways with at least two K steps a split."""
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    k_steps = triton.cdiv(in_features, BLOCK)
    return [WeightOnlyTiles(block_m, block_n, split, num_warps=8 if block_n * block_m >= 128 * 128 else 4,
                            num_stages=2 if block_m >= 128 and block_n >= 128 else 3)
            for block_n in (64, 128)
            for split in (1, 2, 3, 4, 6, 8) if split == 1 or k_steps >= 2 * split]


def weight_only_cycles(tiles: WeightOnlyTiles, rows: int, out_features: int, in_features: int, sms: int) -> float:
    """Estimated GPU cycles of one :func:`weight_only_matmul` launch (one program per SM at a time):
    the waves of programs, each K step the longest of pulling its weight tile into the SM, waiting
    on memory with ``num_stages - 1`` tiles in flight, its tensor-core work and dequantizing the
    tile, bounded below by the whole weight over HBM; plus the split-K reduction. The constants of :func:`estimated_cycles`; ``bench/fp8_gemm.py --sweep`` times
    every candidate against it."""
    steps = triton.cdiv(triton.cdiv(in_features, BLOCK), tiles.split_k)
    programs = triton.cdiv(rows, tiles.block_m) * triton.cdiv(out_features, tiles.block_n) * tiles.split_k
    waves = triton.cdiv(programs, sms)
    step = max(tiles.block_n * BLOCK / SM_BYTES_PER_CYCLE,
               MEMORY_LATENCY_CYCLES / (tiles.num_stages - 1),  # Little's law: stages - 1 tiles in flight
               2 * tiles.block_n * tiles.block_m * BLOCK / H200_FLOPS_PER_SM_CYCLE,
               tiles.block_n * BLOCK * CONVERT_INSTRUCTIONS_PER_W_ELEMENT / 128)
    memory = out_features * in_features * triton.cdiv(rows, tiles.block_m) / HBM_BYTES_PER_CYCLE
    cycles = LAUNCH_CYCLES + max(waves * steps * step, memory) + waves * steps * STEP_OVERHEAD_CYCLES
    if tiles.split_k > 1:
        cycles += tiles.split_k * tiles.block_m * tiles.block_n * 4 / SM_BYTES_PER_CYCLE + L2_LATENCY_CYCLES
    return cycles


def plan_weight_only(rows: int, out_features: int, in_features: int, device: torch.device) -> WeightOnlyTiles:
    """The launch of :func:`weight_only_matmul` for these sizes: the candidate with the fewest
    :func:`weight_only_cycles` (ties: the one listed first, i.e. fewer splits)."""
    return _planned_weight_only(rows, out_features, in_features, _sm_count(device) if device.type == "cuda" else 132)


@functools.lru_cache(maxsize=4096)
def _planned_weight_only(rows: int, out_features: int, in_features: int, sms: int) -> WeightOnlyTiles:
    return min(weight_only_candidates(rows, in_features),
               key=lambda tiles: weight_only_cycles(tiles, rows, out_features, in_features, sms))


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                       tiles: WeightOnlyTiles | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(weight [N, K])ᵀ -> [M, N]`` in ``x``'s dtype, the weight dequantized tile by
    tile in registers (``fp8.dequantize_weight``'s numbers, rounded to ``x``'s dtype) and multiplied on
    the tensor cores in that dtype with fp32 accumulation: the result of ``fp8_linear``'s ``dequant``
    path up to summation order, reading one byte a weight. ``tiles`` overrides :func:`plan_weight_only`."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != cols:
        raise ValueError(f"fp8 GEMM: activations have {cols} channels, the weight {weight.shape[1]}")
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    tiles = tiles or plan_weight_only(rows, out_features, cols, x.device)
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(out_features, tiles.block_n), tiles.split_k)
    counters = _split_counters.get(x.device, grid[0] * grid[1] if tiles.split_k > 1 else 1)
    partials = (torch.empty((tiles.split_k, grid[0] * grid[1], tiles.block_m * tiles.block_n), dtype=torch.float32,
                            device=x.device) if tiles.split_k > 1 else out)
    _weight_only_gemm_kernel[grid](
        x, weight, weight_scales, out, partials, counters, rows, out_features, cols, x.stride(0), weight.stride(0),
        weight_scales.stride(0), out.stride(0), BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m, BLOCK_K=BLOCK,
        SCALE_BLOCK=BLOCK, SPLIT_K=tiles.split_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=_interpreting() and x.dtype != torch.float32, ROUND_BF16=_interpreting() and x.dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out

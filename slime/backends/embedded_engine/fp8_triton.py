"""Triton kernels of the FP8 GEMM (``--fp8-gemm-backend triton``): ``C = A @ Bᵀ`` with block scales.

* ``A [M, K]`` (activations) is quantized per token and 128-channel group by ``_act_quant_kernel``:
  program ``(m, g)`` reads ``x[m, 128g : 128(g+1)]``, ``s = amax / 448`` (1 for an all-zero group),
  writes ``e4m3(x / s)`` and ``s`` to ``a_scales [M, ceil(K/128)]``.
* ``B [N, K]`` is the weight, quantized once per update in 128 x 128 blocks with scales
  ``b_scales [ceil(N/128), ceil(K/128)]`` (``fp8.quantize_weight``).
* ``_gemm_kernel``: program ``(pid_m, pid_n)`` owns ``BLOCK_M`` rows and ``BLOCK_N`` (128, 64 or 32)
  output columns — inside one row of weight blocks, so one weight scale per K step — and walks K in
  steps of 128::

      acc += (A_tile @ B_tileᵀ  in fp32, from e4m3 operands) * a_scale[m, k] * b_scale[n, k]

  then writes ``acc`` in the output dtype. Ragged edges (M, N, K not multiples of the tiles) are
  masked loads of zeros, which add nothing.

Launch on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set
before import; slow, for tests on tiny shapes). No host syncs: capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
import os

import torch

from slime.backends.embedded_engine.fp8 import BLOCK, FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dequantize path of fp8.py is used
    triton = None


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
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, cols, stride_x, stride_q, stride_s, fp8_max,
                          GROUP: tl.constexpr):
        row = tl.program_id(0)
        group = tl.program_id(1)
        offs = group * GROUP + tl.arange(0, GROUP)
        inside = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        # correctly rounded divisions (plain `/` on fp32 is approximate on CUDA), so the scales and values
        # are bit-identical to fp8.quantize_activation's
        scale = tl.where(amax > 0, tl.div_rn(amax, fp8_max), 1.0)
        q = tl.minimum(tl.maximum(tl.div_rn(x, tl.broadcast_to(scale, [GROUP])), -fp8_max), fp8_max)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=inside)
        tl.store(s_ptr + row * stride_s + group, scale)

    @triton.jit
    def _gemm_kernel(a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, M, N, K,
                     stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < M
        in_n = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k = kb * BLOCK_K + offs_k
            in_k = k < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None], mask=in_k[:, None] & in_n[None, :], other=0.0)
            a_scale = tl.load(a_s_ptr + offs_m * stride_asm + kb, mask=in_m, other=0.0)
            b_scale = tl.load(b_s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn + kb)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_n[None, :])


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, ceil(K/128)]``); ``fp8.quantize_activation`` is the reference."""
    rows, cols = x.shape
    groups = triton.cdiv(cols, BLOCK)
    # Triton's interpreter rounds fp32 -> e4m3 wrongly (124.3 -> 64, ties away from even), so under it the
    # kernel writes the scaled fp32 values and torch casts them; compiled kernels cast on the GPU.
    interpreted = _interpreting()
    values = torch.empty((rows, cols), dtype=torch.float32 if interpreted else FP8_DTYPE, device=x.device)
    scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows:
        _act_quant_kernel[(rows, groups)](x, values, scales, cols, x.stride(0), values.stride(0), scales.stride(0),
                                          FP8_MAX, GROUP=BLOCK, num_warps=1)
    return (values.to(FP8_DTYPE) if interpreted else values), scales


MIN_PROGRAMS_PER_SM = 2


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_tiles(rows: int, out_features: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: one row tile up to 128 rows, so a decode step reads every weight byte
    once; columns in tiles of 128, 64 or 32 (each inside one 128-row block of weight scales), the
    widest that still gives every SM two programs (a decode-sized GEMM is a weight read, and a few
    wide tiles would leave most of the GPU idle)."""
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    row_tiles = triton.cdiv(rows, block_m)
    for block_n in (128, 64):
        if row_tiles * triton.cdiv(out_features, block_n) >= MIN_PROGRAMS_PER_SM * _sm_count(device):
            return block_m, block_n
    return block_m, 32


def w8a8_block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                      out_dtype: torch.dtype, block_n: int | None = None) -> torch.Tensor:
    """``x [M, K]`` (any float dtype) times the block-quantized ``weight [N, K]`` transposed -> ``[M, N]``.
    ``block_n`` (32, 64 or 128) overrides the planned column tile (tests)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != cols:
        raise ValueError(f"fp8 GEMM: activations have {cols} channels, the weight {weight.shape[1]}")
    a, a_scales = quantize_activation(x)
    out = torch.empty((rows, out_features), dtype=out_dtype, device=x.device)
    if rows == 0:
        return out
    block_m, planned_n = plan_tiles(rows, out_features, x.device)
    block_n = block_n or planned_n
    if BLOCK % block_n:
        raise ValueError(f"fp8 GEMM: a column tile of {block_n} does not divide the {BLOCK}-row scale blocks")
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
    _gemm_kernel[grid](a, a_scales, weight, weight_scales, out, rows, out_features, cols,
                       a.stride(0), a_scales.stride(0), weight.stride(0), weight_scales.stride(0), out.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK, SCALE_BLOCK=BLOCK,
                       num_warps=8 if block_m * block_n >= 128 * 64 else 4, num_stages=3)
    return out

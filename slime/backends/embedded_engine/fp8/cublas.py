"""cuBLASLt's block-scaled FP8 GEMM (``--fp8-gemm-backend cublas``): DeepSeek-style scaling, exactly ours.

``torch._scaled_mm(a, b, scale_a, scale_b)`` computes ``(a · s_a) @ (b · s_b)`` on cuBLASLt when the
scales describe 1 x 128 blocks of ``a`` and 128 x 128 blocks of ``b`` (PyTorch's ``ScalingType``
``BlockWise1x128`` / ``BlockWise128x128``, cuBLASLt's ``VEC128_32F`` / ``BLK128x128_32F``). The
contract, from PyTorch's ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` (``is_blockwise_1x128_scaling``,
``is_blockwise_128x128_scaling``, ``get_joint_scaling``, ``_scaled_mm_out_cuda``) and
``torch/_meta_registrations.py`` (``_check_scaled_mm_sizes``):

* ``a [M, K]`` e4m3, row-major; ``b [K, N]`` e4m3, column-major — our weight ``[N, K]`` transposed (a
  view). Hopper's cuBLASLt multiplies only row-major x column-major ("TN").
* ``K % 16 == 0`` and ``N % 16 == 0`` (checked by ``_scaled_mm``); M is not checked.
* ``scale_a`` fp32 ``[M, ceil(K/128)]`` with strides ``(1, M)`` ("outer-dim-major": the scales of one
  channel group are contiguous over the tokens) — what ``fp8_triton.quantize_activation`` writes.
* ``scale_b`` fp32 ``[ceil(K/128), ceil(N/128)]`` whose transpose is row-major: our
  ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` transposed (a view).
* DeepSeek-style scaling runs on sm_90 only and needs cuBLASLt >= 12.9 (``_check_deepseek_support``);
  PyTorch's error for a wrong layout says the 128 x 128 scales need 16-byte aligned strides.

So this path needs no copy of the weight. The activations are quantized first by the Triton
quantizer (one launch; the rounding of ``fp8.quantize_activation``) with the tokens padded to a
multiple of :data:`ROW_ALIGN`. Shapes it does not take (:func:`shape_supported`) fall back to the
two-kernel Triton GEMM, said once per shape in the log (``fp8.gemm_path``); so does everything under
``auto`` on a GPU where the first, eager use finds that cuBLASLt refuses the recipe or computes
something else than the reference (:func:`check_block_matmul`; a warning says which). Two launches, no host
syncs: capturable in a CUDA graph. ``use_fast_accum`` stays off (cuBLASLt then promotes the
accumulator out of the tensor cores' limited-precision sum).
"""

from __future__ import annotations

import functools
import logging

import torch

from slime.backends.embedded_engine.fp8.numerics import BLOCK, dequantize_weight, quantize_activation, reference_matmul
from slime.backends.embedded_engine.fp8.quantize import quantize_weight

logger = logging.getLogger(__name__)

# Tokens padded to a multiple of this before cuBLASLt (zero rows, scale 1; the output rows are sliced
# away): a safety margin for cuBLASLt's FP8 alignment rules, which PyTorch does not check for M. It
# costs nothing measurable at decode sizes, where reading the weight dominates. Not yet measured
# against ROW_ALIGN = 1 on the GPU.
ROW_ALIGN = 16


@functools.lru_cache(maxsize=None)
def _device_supported(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    return major == 9


def _cuda_version() -> tuple[int, int]:
    """The CUDA toolkit torch was built with (``torch.version.cuda``, "13.0" -> (13, 0)); (0, 0) without CUDA."""
    try:
        major, minor = (torch.version.cuda or "0.0").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0


_checked: dict[int, str | None] = {}  # CUDA device index -> None (the check GEMM came out right) or why not


def unavailable_reason(device: torch.device | str) -> str | None:
    """None where cuBLASLt's DeepSeek-style FP8 GEMM runs on ``device`` and computes the right numbers,
    else why not. Needed: a Hopper (sm_90) GPU, a torch built with CUDA >= 12.9 (its cuBLASLt has the
    block-scaled kernels) and with ``torch._scaled_mm``, triton (the activation quantizer); then, once
    per GPU, :func:`check_block_matmul` must pass — the layout contract above was read from PyTorch's
    source, so the first use on a GPU checks it against the reference rather than trusting it."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "it needs a CUDA device"
    if not hasattr(torch, "_scaled_mm") or _cuda_version() < (12, 9):
        return f"it needs a torch built with CUDA >= 12.9 (this one: torch {torch.__version__}, CUDA {torch.version.cuda})"
    if not fp8_triton.available(device):
        return "it needs triton (the activation quantizer)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _device_supported(index):
        return f"it runs on sm_90 (Hopper) only; this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(index)))}"
    if index not in _checked:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8 GEMM: cuBLASLt's block-scaled GEMM is first needed during CUDA graph capture; "
                               "call fp8_cublas.available(device) eagerly before capturing (resolve_backend does)")
        _checked[index] = check_block_matmul(torch.device("cuda", index))
        if _checked[index] is not None:
            logger.warning("fp8 GEMM: not using cuBLASLt's block-scaled FP8 GEMM on cuda:%d: %s", index, _checked[index])
    return _checked[index]


def available(device: torch.device | str) -> bool:
    """Whether :func:`block_matmul` runs on ``device`` (:func:`unavailable_reason` says why not)."""
    return unavailable_reason(device) is None


def check_block_matmul(device: torch.device) -> str | None:
    """One small GEMM (``[32 x 1024] x [384 x 1024]ᵀ``) on ``device`` through :func:`block_matmul` against
    ``fp8.reference_matmul``, with magnitudes that differ per token, per 128-channel group and per row
    of weight blocks (so a scale read from the wrong place, or a layout read transposed, shows): None
    when every output is within the tensor cores' accumulation bound plus the bf16 output's rounding
    (``2^-12 · (|x_q| @ |W|ᵀ) + 2^-8 · |reference|``), else what went wrong (the library's error, or
    how far out the result is)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1024, generator=generator) * torch.logspace(-2, 2, 32)[:, None]
    x = (x * torch.logspace(-1, 1, 8).repeat_interleave(128)[None, :]).to(device, torch.bfloat16)
    weight = torch.randn(384, 1024, generator=generator) * torch.logspace(-1, 1, 3).repeat_interleave(128)[:, None]
    weight = weight * torch.logspace(1, -1, 8).repeat_interleave(128)[None, :] / 32
    values, scales = quantize_weight(weight.to(device))
    try:
        out = block_matmul(x, values, scales, torch.bfloat16).float()
    except (RuntimeError, ValueError, TypeError) as error:  # NotImplementedError is a RuntimeError
        return f"torch._scaled_mm refused the block-scaled GEMM: {type(error).__name__}: {str(error)[:400]}"
    reference = reference_matmul(x, values, scales, quantize_inputs=True)
    q, s = quantize_activation(x)
    magnitude = (q.float() * s.repeat_interleave(BLOCK, dim=-1)).abs() @ dequantize_weight(values, scales).abs().T
    excess = float(((out - reference).abs() / (magnitude * 2.0**-12 + reference.abs() * 2.0**-8 + 1e-12)).max())
    if not excess <= 1:  # NaN included
        return (f"its result differs from fp8.reference_matmul by {excess:.3g}x the accumulation bound (a layout "
                "contract of torch._scaled_mm that this torch does not keep?)")
    return None


def shape_supported(out_features: int, in_features: int) -> bool:
    """The weight shapes this path takes: ``N % 16 == 0`` (``_scaled_mm``'s own check) and whole 128-channel
    groups, a multiple of 4 of them (``K % 512 == 0``: the 128 x 128 scales' row stride ``K / 128`` fp32 is
    then 16-byte aligned, as PyTorch's error text asks). Every linear of Qwen3 0.6B/1.7B/4B qualifies."""
    return out_features % 16 == 0 and in_features % (4 * BLOCK) == 0


def block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``x [M, K]`` (any float dtype) times the block-quantized ``weight [N, K]`` (scales
    ``[ceil(N/128), ceil(K/128)]``) transposed -> ``[M, N]`` in ``out_dtype``, on cuBLASLt. The caller
    checks :func:`available` and :func:`shape_supported`."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    rows = x.shape[0]
    if rows == 0:
        return torch.empty((0, weight.shape[0]), dtype=out_dtype, device=x.device)
    values, scales = fp8_triton.quantize_activation(x, row_align=ROW_ALIGN)
    out = torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scales.t(), out_dtype=out_dtype,
                           use_fast_accum=False)
    return out[:rows]

"""The block-wise weight quantizer: one Triton launch on CUDA (``triton_kernels.py``), the torch reference
of ``numerics.py`` elsewhere; the same numbers either way."""

from __future__ import annotations

import torch

from slime.backends.embedded_engine.fp8.numerics import FP8_DTYPE, _blocks, _quantize_weight_torch


def _triton_quantizes(weight: torch.Tensor) -> bool:
    """Whether :func:`quantize_weight` runs ``fp8_triton``'s one-pass kernel on ``weight``: on CUDA with
    Triton (the CPU keeps the torch version, the reference the kernel is tested against)."""
    if not weight.is_cuda or weight.dim() > 3:
        return False
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    return fp8_triton.available(weight.device)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` -> (e4m3 values ``[..., N, K]``, fp32 scales ``[..., ceil(N/128), ceil(K/128)]``).
    Leading dimensions (experts) are quantized independently. On CUDA one Triton launch
    (``fp8_triton.quantize_weight_into``, the same numbers), elsewhere :func:`_quantize_weight_torch`."""
    if _triton_quantizes(weight):
        *lead, rows, cols = weight.shape
        values = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        scales = torch.empty((*lead, _blocks(rows), _blocks(cols)), dtype=torch.float32, device=weight.device)
        quantize_weight_into(weight, values, scales)
        return values, scales
    return _quantize_weight_torch(weight)


@torch.no_grad()
def quantize_weight_into(weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """:func:`quantize_weight` into existing storage (a weight update: captured CUDA graphs keep
    reading the same buffers); on CUDA without an intermediate copy."""
    if _triton_quantizes(weight) and values.stride(-1) == 1 and scales.stride(-1) == 1:
        from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

        fp8_triton.quantize_weight_into(weight, values, scales)
        return
    new_values, new_scales = _quantize_weight_torch(weight)
    values.copy_(new_values)
    scales.copy_(new_scales)

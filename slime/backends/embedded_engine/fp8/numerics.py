"""Block-wise FP8's numbers in plain torch: the e4m3 format's constants, the 128 x 128 weight blocks and
1 x 128 activation groups (the formula in ``block.py``), dequantization and the reference GEMM that the
Triton and cuBLASLt kernels are tested against. Imports no other FP8 module."""

from __future__ import annotations

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # divided by a tensor, not the Python number: PyTorch's CUDA kernels multiply by the reciprocal
    # of a scalar divisor (off by an ulp), and the Triton quantizer divides with correct rounding
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def _quantize_weight_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight` in torch ops (the reference; the CPU's path)."""
    *lead, rows, cols = weight.shape
    w = weight.float().reshape(-1, rows, cols)
    nb, kb = _blocks(rows), _blocks(cols)
    padded = torch.zeros((w.shape[0], nb * BLOCK, kb * BLOCK), dtype=torch.float32, device=w.device)
    padded[:, :rows, :cols] = w  # zero padding does not change a ragged block's amax
    tiles = padded.view(-1, nb, BLOCK, kb, BLOCK)
    scales = _scales_from_amax(tiles.abs().amax(dim=(2, 4)))
    values = (tiles / scales[:, :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    values = values.view(-1, nb * BLOCK, kb * BLOCK)[:, :rows, :cols]
    return values.reshape(*lead, rows, cols).contiguous(), scales.reshape(*lead, nb, kb)


def dequantize_weight(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_weight`: ``values * scale`` of each element's block, in ``dtype``."""
    *lead, rows, cols = values.shape
    nb, kb = scales.shape[-2:]
    if rows == nb * BLOCK and cols == kb * BLOCK:  # whole blocks: broadcast the scales, no expanded copy
        tiles = values.float().view(*lead, nb, BLOCK, kb, BLOCK) * scales[..., :, None, :, None]
        return tiles.view(*lead, rows, cols).to(dtype)
    expanded = scales.repeat_interleave(BLOCK, dim=-2)[..., :rows, :].repeat_interleave(BLOCK, dim=-1)[..., :cols]
    return (values.float() * expanded).to(dtype)


@torch.no_grad()
def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, fp32 scales ``[M, ceil(K/128)]``): one scale per token and
    128-channel group (the reference of the Triton activation quantizer and of the fused GEMM's own)."""
    rows, cols = x.shape
    kb = _blocks(cols)
    padded = torch.zeros((rows, kb * BLOCK), dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    groups = padded.view(rows, kb, BLOCK)
    scales = _scales_from_amax(groups.abs().amax(dim=-1))
    values = (groups / scales[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(rows, -1)[:, :cols]
    return values.contiguous(), scales


def reference_matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                     quantize_inputs: bool) -> torch.Tensor:
    """fp32 ``x [M, K] @ dequant(W)ᵀ`` (``x`` rounded through :func:`quantize_activation` first when
    ``quantize_inputs``): what the Triton GEMM computes, written plainly."""
    if quantize_inputs:
        q, s = quantize_activation(x)
        x = q.float() * s.repeat_interleave(BLOCK, dim=-1)[:, : x.shape[1]]
    return x.float() @ dequantize_weight(values, scales, torch.float32).T

"""Block-wise FP8's numbers (``fp8/numerics.py``): the weight round trip within half an e4m3 spacing, zero
blocks, per-token activation groups, and the tensor cores' accumulation bound the GEMM tests hold outputs to."""

from __future__ import annotations

import math

import pytest
import torch

from slime.backends.embedded_engine.fp8 import numerics as fp8_numerics
from slime.backends.embedded_engine.fp8 import quantize as fp8_quantize
from fp8_test_utils import assert_within_mma_tolerance, mma_tolerance


RAGGED = [(128, 128), (200, 300), (1, 5), (64, 384), (3, 130, 257)]  # (experts, N, K) last


def _error_bound(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 spacing of each element, in weight units: 2^-4 relative for normal e4m3 values
    (3 mantissa bits), 2^-10 of the block scale in the subnormal range (|w / s| < 2^-6)."""
    rows, cols = weight.shape[-2:]
    block = fp8_numerics.BLOCK
    scale = scales.repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]
    return torch.maximum(weight.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)


@pytest.mark.parametrize("shape", RAGGED)
def test_weight_round_trip_is_within_half_an_e4m3_spacing(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, shape[-1])
    values, scales = fp8_quantize.quantize_weight(weight)
    assert values.dtype == torch.float8_e4m3fn and values.shape == weight.shape
    assert scales.dtype == torch.float32
    assert scales.shape == (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    back = fp8_numerics.dequantize_weight(values, scales)
    assert torch.all((back - weight).abs() <= _error_bound(weight, scales))
    # the scale of each block is its amax / 448, so every block's largest element maps to exactly 448
    rows, cols = shape[-2:]
    for i in range(scales.shape[-2]):
        for j in range(scales.shape[-1]):
            block = weight[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = block.abs().amax(dim=(-2, -1))
            torch.testing.assert_close(scales[..., i, j], amax / 448.0, rtol=0, atol=0)
            stored = values[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs().amax(dim=(-2, -1))
            assert torch.all(stored == 448.0)


def test_zero_blocks_and_bf16_inputs():
    weight = torch.zeros(130, 130, dtype=torch.bfloat16)
    weight[129, 129] = 3.0  # only the ragged corner block is non-zero
    values, scales = fp8_quantize.quantize_weight(weight)
    assert scales.tolist() == [[1.0, 1.0], [1.0, float(torch.tensor(3.0) / 448)]]  # fp32 division
    back = fp8_numerics.dequantize_weight(values, scales, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back, weight)


def test_activation_quantization_is_per_token_and_group():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    x[2] *= 1000  # one loud token does not coarsen the others
    values, scales = fp8_numerics.quantize_activation(x)
    assert scales.shape == (5, 3)
    torch.testing.assert_close(scales[:, 0], x[:, :128].abs().amax(-1) / 448, rtol=0, atol=0)
    scale = scales.repeat_interleave(128, -1)[:, :300]
    back = values.float() * scale
    assert torch.all((back - x).abs() <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6))


def test_mma_tolerance_catches_wrong_scales_and_missing_splits():
    """The GPU tests' bound has teeth: against the exact reference, one weight block's scale off by 2x,
    one token's activation scale off by 2x, or the K range of one split-K partial missing each exceed
    it by far, while an fp32 result in another summation order stays inside."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(64, 1024, generator=generator)
    weight = torch.randn(256, 1024, generator=generator) / 32
    values, scales = fp8_quantize.quantize_weight(weight)
    reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
    tolerance = mma_tolerance(x, values, scales)
    reordered = sum(fp8_numerics.reference_matmul(x[:, k:k + 256], values[:, k:k + 256],
                                                  scales[:, k // 128:(k + 256) // 128], quantize_inputs=True)
                    for k in range(0, 1024, 256))
    assert_within_mma_tolerance(reordered, reference, tolerance)
    wrong_block = scales.clone()
    wrong_block[1, 3] *= 2
    mutants = {"weight block scale x2": fp8_numerics.reference_matmul(x, values, wrong_block, quantize_inputs=True)}
    q, s = fp8_numerics.quantize_activation(x)
    s[5, 2] *= 2
    x_wrong = q.float() * s.repeat_interleave(128, dim=-1)
    mutants["token scale x2"] = x_wrong @ fp8_numerics.dequantize_weight(values, scales).T
    missing = x.clone()
    missing[:, 512:768] = 0  # split 3 of 4 (two K steps each) never added
    mutants["split partial missing"] = fp8_numerics.reference_matmul(missing, values, scales, quantize_inputs=True)
    for name, mutant in mutants.items():
        with pytest.raises(AssertionError, match="exceeds the MMA bound"):
            assert_within_mma_tolerance(mutant, reference, tolerance)

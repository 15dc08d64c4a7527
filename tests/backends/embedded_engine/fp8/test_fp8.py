"""FP8 rollout (``--quantization fp8``): the block quantizer's math, the Triton GEMM against its
reference, the weight-update name mapping, and greedy decoding of a quantized tiny model.

The Triton tests run on the CPU only under Triton's interpreter: ``bash scripts/test.sh`` runs this
file a second time with ``PYTHONPATH=.venv/triton-interpreter TRITON_INTERPRET=1``; on CUDA the
``gpu`` test runs the compiled kernels.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
from torch import nn

from slime.backends.embedded_engine.fp8 import block as fp8
from slime.backends.embedded_engine.fp8 import install as fp8_install
from slime.backends.embedded_engine.fp8 import numerics as fp8_numerics
from slime.backends.embedded_engine.fp8 import quantize as fp8_quantize

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")

RAGGED = [(128, 128), (200, 300), (1, 5), (64, 384), (3, 130, 257)]  # (experts, N, K) last


def _error_bound(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 spacing of each element, in weight units: 2^-4 relative for normal e4m3 values
    (3 mantissa bits), 2^-10 of the block scale in the subnormal range (|w / s| < 2^-6)."""
    rows, cols = weight.shape[-2:]
    scale = scales.repeat_interleave(fp8_numerics.BLOCK, -2)[..., :rows, :].repeat_interleave(fp8_numerics.BLOCK, -1)[..., :cols]
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


def test_dequant_linear_equals_matmul_with_the_dequantized_weight():
    torch.manual_seed(0)
    linear = nn.Linear(300, 200, bias=True)
    module = fp8.Fp8Linear(linear, "dequant")
    x = torch.randn(4, 7, 300)
    linear.requires_grad_(False)
    weight = fp8_numerics.dequantize_weight(module.weight_fp8, module.weight_scale_inv)
    torch.testing.assert_close(module(x), x @ weight.T + linear.bias)
    # and close to the full-precision layer (e4m3 keeps ~2 significant digits of each weight)
    exact = linear(x)
    assert float((module(x) - exact).norm() / exact.norm()) < 0.05


def test_unknown_quantization_and_backend_are_refused(tiny_model_dir):
    from slime.backends.embedded_engine.config import parse_args

    with pytest.raises(SystemExit, match="--quantization 'awq' is not supported"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "awq"])
    with pytest.raises(SystemExit, match="--fp8-gemm-backend 'marlin'"):
        parse_args(["--model-path", tiny_model_dir, "--quantization", "fp8", "--fp8-gemm-backend", "marlin"])
    for backend in ("triton", "cublas"):
        with pytest.raises(SystemExit, match=f"--fp8-gemm-backend {backend} runs on --device cuda"):
            parse_args(["--model-path", tiny_model_dir, "--quantization", "fp8", "--fp8-gemm-backend", backend])
    assert parse_args(["--model-path", tiny_model_dir, "--quantization", "fp8"]).quantization == "fp8"


# ---------------------------------------------------------------------------------- the Triton kernel
# Under the interpreter these check the fused kernel's arithmetic: the in-kernel activation amax and
# scale, the division (reciprocal + fma correction) against the reference's correctly rounded one,
# masking of ragged edges, the per-column weight scales, the dot and the split-K reduction. They cannot
# check the GPU's own fp32 -> e4m3 cast (the interpreter's is wrong, so the kernel rounds onto the e4m3
# grid itself there; the ``gpu`` test below compares the compiled kernel) nor speed (bench/fp8_gemm.py).
def _tiles(*args):
    from slime.backends.embedded_engine.fp8.triton_kernels import Tiles

    return Tiles(*args)


@needs_interpreter
@pytest.mark.parametrize("rows,out_features,in_features,tiles", [
    (1, 200, 300, None), (5, 128, 128, (16, 64)), (40, 64, 384, (64, 32)), (130, 40, 256, (128, 256)),
    (5, 200, 300, (16, 64, 2)),  # split K, ragged N and K
    (40, 96, 640, (64, 32, 3)),  # 5 K steps over 3 splits: 2 + 2 + 1
    (3, 64, 256, (16, 32, 4)),  # more splits than K steps: two programs of the tile have no K step
])
def test_triton_gemm_interpreted_equals_reference(rows, out_features, in_features, tiles):
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-2, 1, in_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    values, scales = fp8_quantize.quantize_weight(weight)
    out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles and _tiles(*tiles))
    reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
    # the same quantized operands, summed in another order: fp32 rounding apart (one activation
    # element an e4m3 step off moves an output by ~1e-3 of its scale)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    exact = x @ weight.T  # both operands rounded to e4m3: a few percent of the output's norm
    assert float((out - exact).norm() / exact.norm()) < 0.06
    if tiles and len(tiles) > 2:  # the last program of each tile reset its counter: the next GEMM starts at 0
        assert not fp8_triton._split_counters.by_device[x.device].any()
        assert torch.equal(fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=_tiles(*tiles)), out)


def _weight_only_reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ W_deqᵀ`` with the weight dequantized to ``x``'s dtype (the ``dequant`` path's numbers)."""
    return x.float() @ fp8_numerics.dequantize_weight(values, scales, x.dtype).float().T


@needs_interpreter
@pytest.mark.parametrize("rows,out_features,in_features,tiles,dtype", [
    (1, 200, 300, None, torch.float32),  # planned; ragged N and K (a partial block row and column)
    (17, 130, 257, None, torch.bfloat16),
    (5, 256, 1024, (16, 64, 4), torch.bfloat16),  # split K: 8 K steps over 4 splits, 4 column tiles
    (40, 96, 640, (64, 128, 3), torch.float32),  # 5 K steps over 3 splits: 2 + 2 + 1; a tile wider than N
    (130, 64, 256, (128, 64, 2), torch.bfloat16),  # two token tiles, the second holding 2 rows
    (3, 200, 256, (16, 64, 4), torch.float32),  # more splits than K steps: two programs add nothing
])
def test_weight_only_gemm_interpreted_equals_the_dequantized_matmul(rows, out_features, in_features, tiles, dtype):
    """The weight-only (W8A16) kernel: the weight dequantized per 128 x 128 block (its scales read per
    weight row and K step, ragged edges masked), the transposed product stored in ``[M, N]``, split-K
    partials summed, in the activations' dtype. fp32: the dequant path's product to summation order;
    bf16: within the output's rounding (a wrong block scale moves outputs by tens of percent)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(rows + out_features)
    x = (torch.randn(rows, in_features, generator=generator) * torch.logspace(-2, 1, in_features)).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator) * torch.logspace(1, -2, out_features)[:, None]
    values, scales = fp8_quantize.quantize_weight(weight)
    out = fp8_triton.weight_only_matmul(x, values, scales, tiles=tiles and fp8_triton.WeightOnlyTiles(*tiles))
    assert out.dtype == dtype and out.shape == (rows, out_features)
    reference = _weight_only_reference(x, values, scales)
    if dtype == torch.float32:
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    else:  # bf16 products are exact in fp32; the sum is fp32; one rounding to bf16 at the end
        assert bool(((out.float() - reference).abs() <= reference.abs() * 2.0**-8 + 1e-6).all())
    if tiles and tiles[2] > 1:  # the last program of each tile reset its counter: the next GEMM starts at 0
        assert not fp8_triton._split_counters.by_device[x.device].any()
        again = fp8_triton.weight_only_matmul(x, values, scales, tiles=fp8_triton.WeightOnlyTiles(*tiles))
        assert torch.equal(again, out)


@needs_interpreter
def test_weight_only_linear_interpreted_equals_the_dequant_backend():
    """``Fp8Linear`` under ``weight_only`` (bf16, with bias) gives the ``dequant`` backend's output to
    bf16 rounding: the two serve the same numbers, one reading one byte a weight."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 200, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    assert fp8.gemm_path("weight_only", 15, 200, 256, x.device) == "weight_only"
    out = fp8.Fp8Linear(linear, "weight_only")(x)
    expected = fp8.Fp8Linear(linear, "dequant")(x)
    assert out.shape == (3, 5, 200) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=2**-7)


def test_weight_only_plan_fills_the_gpu_for_qwen3_decode_shapes():
    """The weight-only plan at decode sizes on an H200's 132 SMs: one token tile up to 128 tokens, and
    up to 16 tokens (where a step only streams the weight) at least half the SMs busy on every (fused)
    Qwen3 linear, by narrower weight tiles or split K (one wave: 96 programs of 4 K steps beat 144 of 3,
    which take two waves). From 64 tokens the tensor-core work and the split-K reduction's partials
    weigh in, and the model may leave more SMs idle."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if fp8_triton.triton is None:
        pytest.skip("needs the triton package for its cdiv helpers")
    for out_features, in_features in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (4096, 2048),
                                      (12288, 2048), (2048, 6144), (6144, 2560), (2560, 4096), (19456, 2560),
                                      (2560, 9728)]:
        for rows in (1, 16, 64, 128):
            tiles = fp8_triton._planned_weight_only(rows, out_features, in_features, 132)
            assert tiles.block_m == max(16, 1 << (rows - 1).bit_length()), (rows, tiles)
            programs = -(-out_features // tiles.block_n) * tiles.split_k
            assert rows > 16 or programs >= 132 // 2, (rows, out_features, in_features, tiles)


def _e4m3_midpoints() -> torch.Tensor:
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    return (grid[:-1] + grid[1:]) / 2


def _e4m3_ties() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties, subnormal ones included) and the
    fp32 numbers just either side of each midpoint, positive and negative."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = _e4m3_midpoints()
    near = torch.cat([grid, mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid + 1)])
    return torch.cat([near, -near])


@needs_interpreter
def test_triton_gemm_interpreted_rounds_ties_like_the_gpu_cast():
    """Activations sitting on e4m3 rounding boundaries (ties to even, carries into the exponent such as
    124.3 -> 128): each group's amax is 448, so its scale is exactly 1 and the in-kernel rounding of
    these values decides the output."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    rows, cols = 8, 128 * 4
    generator = torch.Generator().manual_seed(0)
    pool = _e4m3_ties().repeat(5)
    x = pool[torch.randperm(len(pool), generator=generator)[: rows * cols]].reshape(rows, cols)
    x[:, ::128] = 448.0  # amax 448 -> scale 1 in every group
    x[0, 5] = 124.3
    weight = torch.randn(64, cols, generator=generator) / cols**0.5
    w_values, w_scales = fp8_quantize.quantize_weight(weight)
    out = fp8_triton.w8a8_block_matmul(x, w_values, w_scales, torch.float32, tiles=_tiles(16, 32, 2))
    reference = fp8_numerics.reference_matmul(x, w_values, w_scales, quantize_inputs=True)
    tolerance = dict(rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    torch.testing.assert_close(out, reference, **tolerance)
    # the check has teeth: rounding the ties away from zero instead moves the outputs well past it
    ties = torch.isin(x.abs(), _e4m3_midpoints())
    away = torch.where(ties, torch.nextafter(x, 2 * x), x)
    assert not torch.allclose(fp8_numerics.reference_matmul(away, w_values, w_scales, quantize_inputs=True), reference, **tolerance)


@needs_interpreter
def test_triton_gemm_interpreted_divides_like_the_reference_next_to_ties():
    """``x / s`` for values within two fp32 ulps of ``(e4m3 midpoint) · s`` at 64 random scales: there
    the e4m3 result hangs on the last bit of the quotient (``x · (1/s)`` without the kernel's fma
    correction rounds ~4 % of these differently)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(3)
    rows, groups = 64, 5
    amax = torch.rand(rows, generator=generator) * 3 + 0.1
    scale = amax / torch.full_like(amax, 448.0)
    near = [_e4m3_midpoints()[None, :] * scale[:, None]]
    for towards in (1e9, 0.0, 1e9, 0.0):  # +1, -1, +2, -2 ulps
        start = near[0] if len(near) < 3 else near[-2]
        near.append(torch.nextafter(start, torch.full_like(start, towards)))
    near = torch.cat(near, dim=1)  # [rows, 630]
    x = torch.empty(rows, groups, 128)
    x[:, :, 0] = amax[:, None]  # every group's amax, so its scale is `scale`
    x[:, :, 1:] = near[:, torch.randperm(groups * 127, generator=generator) % near.shape[1]].view(rows, groups, 127)
    x = x.view(rows, groups * 128)
    weight = torch.randn(96, groups * 128, generator=generator) / 25
    w_values, w_scales = fp8_quantize.quantize_weight(weight)
    out = fp8_triton.w8a8_block_matmul(x, w_values, w_scales, torch.float32, tiles=_tiles(64, 32, 2))
    reference = fp8_numerics.reference_matmul(x, w_values, w_scales, quantize_inputs=True)
    tolerance = dict(rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    torch.testing.assert_close(out, reference, **tolerance)
    # the check has teeth: multiplying by the rounded reciprocal alone lands elsewhere
    inverse = (1 / scale)[:, None, None]
    naive = (x.view(rows, groups, 128) * inverse).to(torch.float8_e4m3fn).float() * scale[:, None, None]
    naive_out = naive.view(rows, -1) @ fp8_numerics.dequantize_weight(w_values, w_scales).T
    assert not torch.allclose(naive_out, reference, **tolerance)


@needs_interpreter
def test_e4m3_grid_rounding_equals_torch_cast():
    """The interpreter-side rounding (``_round_to_e4m3_grid``) against torch's fp32 -> e4m3 cast on
    every tie, its neighbours and random values over the whole e4m3 range."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(2)
    random = (torch.rand(20000, generator=generator) * 2 - 1) * torch.logspace(-12, 0, 20000) * 448
    x = torch.cat([_e4m3_ties(), random])
    assert torch.equal(fp8_triton.round_to_e4m3_grid(x), x.to(torch.float8_e4m3fn).float())


@needs_interpreter
def test_tile_plan_fills_the_gpu_for_qwen3_decode_shapes(monkeypatch):
    """With an H200's 132 SMs every Qwen3 0.6B/1.7B/4B linear at decode batch sizes gets >= 7/8 of an SM
    count of programs; up to 64 rows are one row tile (each weight byte read once); each split keeps
    >= 2 K steps; prefill (2048 rows) has tiles enough and does not split."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    monkeypatch.setattr(fp8_triton, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    for hidden, intermediate, q_out, kv_out in [(1024, 3072, 2048, 1024), (2048, 6144, 2048, 1024),
                                                (2560, 9728, 4096, 1024)]:
        shapes = [(q_out, hidden), (kv_out, hidden), (hidden, q_out), (intermediate, hidden), (hidden, intermediate)]
        for out_features, in_features in shapes:
            for rows, a_quantized in [(rows, a_quantized) for rows in (1, 16, 64, 128) for a_quantized in (False, True)]:
                tiles = fp8_triton.plan_tiles(rows, out_features, in_features, cpu, a_quantized=a_quantized)
                programs = -(-rows // tiles.block_m) * -(-out_features // tiles.block_n) * tiles.split_k
                assert programs >= 116, (rows, out_features, in_features, tiles)
                assert rows > 64 or tiles.block_m >= rows, tiles
                assert tiles.split_k == 1 or in_features // 128 >= 2 * tiles.split_k, tiles
            for a_quantized in (False, True):
                assert fp8_triton.plan_tiles(2048, out_features, in_features, cpu, a_quantized=a_quantized).split_k == 1


_SM90_COMPILE = """
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

kernel = fp8_triton._fp8_gemm_kernel
names = list(kernel.arg_names)
constexprs = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "SCALE_BLOCK", "SPLIT_K", "A_QUANTIZED", "TMA", "ACCUMULATE",
              "EMULATE_E4M3_CAST", "PER_CHANNEL"]
aligned = ["a_ptr", "a_s_ptr", "b_ptr", "b_s_ptr", "c_ptr", "partial_ptr", "counter_ptr", "N", "K", "stride_am",
           "stride_bn", "stride_cm"]  # what the JIT specializes on at run time (16-byte pointers, sizes divisible by 16)
attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
report = []
for block_m, block_n, split_k, num_warps, a_quantized, tma, num_stages, *per_channel in json.loads(sys.argv[1]):
    per_channel = bool(per_channel and per_channel[0])  # an 8th entry: the kernel's PER_CHANNEL mode (fp8_channel)
    types = dict(a_ptr="*fp8e4nv" if a_quantized else "*bf16", a_s_ptr="*fp32", b_ptr="*fp8e4nv", b_s_ptr="*fp32",
                 c_ptr="*bf16", partial_ptr="*fp32", counter_ptr="*i32", fp8_max="fp32")
    types["a_desc"] = f"tensordesc<fp8e4nv[{block_m}, 128]>" if tma else types["a_ptr"]
    types["b_desc"] = f"tensordesc<fp8e4nv[{block_n}, 128]>" if tma else types["b_ptr"]
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in names}
    values = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SCALE_BLOCK=128, SPLIT_K=split_k,
                  A_QUANTIZED=bool(a_quantized), TMA=bool(tma), ACCUMULATE=bool(tma and split_k > 1),
                  EMULATE_E4M3_CAST=False, PER_CHANNEL=per_channel)
    compiled = triton.compile(ASTSource(kernel, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    path = os.path.join(sys.argv[2], f"k{block_m}_{block_n}_{split_k}_{a_quantized}_{tma}_{per_channel}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    ptx = compiled.asm["ptx"]
    report.append(dict(tiles=[block_m, block_n, split_k, num_warps, a_quantized, tma, num_stages],
                       # the wgmma groups a thread may leave in flight at each wait (0: it waits on every dot)
                       wgmma_waits=sorted({int(n) for n in
                                           re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx)}),
                       fp8_wgmma=bool(re.search(r"wgmma\\.mma_async[\\w.]*\\.e4m3\\.e4m3", ptx)),
                       tma_loads="cp.async.bulk.tensor" in ptx, shared=compiled.metadata.shared,
                       mma_sync="mma.sync.aligned" in ptx,
                       gpu_e4m3_cast="cvt.rn.satfinite.e4m3x2.f32" in ptx,
                       registers=int(re.search(r"REG:(\\d+)", usage).group(1)),
                       stack=int(re.search(r"STACK:(\\d+)", usage).group(1))))
quantizer = fp8_triton._quantize_activation_kernel
q_names = list(quantizer.arg_names)
q_types = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", fp8_max="fp32")
q_signature = {name: "constexpr" if name in ("BLOCK_M", "EMULATE_E4M3_CAST") else q_types.get(name, "i32")
               for name in q_names}
q_attrs = {(q_names.index(name),): [["tt.divisibility", 16]] for name in ("x_ptr", "q_ptr", "s_ptr", "K", "stride_xm",
                                                                          "stride_qm")}
compiled = triton.compile(ASTSource(quantizer, q_signature, dict(BLOCK_M=fp8_triton.QUANTIZE_BLOCK_M,
                                                                 EMULATE_E4M3_CAST=False), q_attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
path = os.path.join(sys.argv[2], "quantizer.cubin")
with open(path, "wb") as f:
    f.write(compiled.asm["cubin"])
usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
report.append(dict(tiles="quantizer", gpu_e4m3_cast="cvt.rn.satfinite.e4m3x2.f32" in compiled.asm["ptx"],
                   stack=int(re.search(r"STACK:(\\d+)", usage).group(1))))
print(json.dumps(report))
"""


@needs_interpreter
def test_planned_tiles_compile_for_h200_without_spilling(tmp_path):
    """The compiled kernel (not the interpreter) for sm_90, without a GPU: Triton's own ptxas builds
    the planned launches of the Qwen3 shapes (one of each kind: few rows, split K, 256 columns, a
    128-row prefill tile; fused, and the two-kernel GEMM on e4m3 A), each with tensor-core
    instructions, the GPU's own fp32 -> e4m3 cast where it quantizes and no register spills; the
    two-kernel GEMM's TMA launches (the planned 64 x 128 tiles with 3 and 4 stages, 64 x 64 with 5 and 4)
    load by ``cp.async.bulk.tensor`` and fit three / two programs an SM in shared memory."""
    import json
    import subprocess
    import sys

    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not os.path.exists(os.path.join(os.path.dirname(fp8_triton.triton.__file__), "backends", "nvidia", "bin",
                                       "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    tiles = [(16, 32, 4, 4, 0, 0, 3), (64, 128, 4, 8, 0, 0, 3), (64, 256, 1, 8, 0, 0, 3), (128, 128, 1, 8, 0, 0, 3),
             (64, 128, 2, 8, 1, 0, 3), (128, 128, 1, 8, 1, 0, 3), (64, 128, 1, 4, 1, 1, 3), (64, 128, 2, 4, 1, 1, 4),
             (16, 128, 4, 4, 1, 1, 4), (64, 64, 1, 4, 1, 1, 5), (64, 64, 4, 4, 1, 1, 4)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_BACKENDS_IN_TREE="1", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", _SM90_COMPILE, json.dumps(tiles), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    quantizer = report.pop()  # the separate activation quantizer: the GPU's own cast, no spills
    assert quantizer["tiles"] == "quantizer" and quantizer["gpu_e4m3_cast"] and quantizer["stack"] == 0, quantizer
    assert [entry["tiles"] for entry in report] == [list(t) for t in tiles]
    for entry in report:
        assert entry["stack"] == 0, entry
        assert entry["gpu_e4m3_cast"] != bool(entry["tiles"][4]), entry  # the two-kernel GEMM does not quantize
        # Hopper's fp8 wgmma from 64 rows; smaller tiles take mma.sync on the exact fp16 widening of e4m3
        assert entry["fp8_wgmma"] if entry["tiles"][0] >= 64 else entry["mma_sync"], entry
        # each K step's dot is scaled by its block's scales before the next: every wgmma waited on at once
        # (fp8_channel's per-channel mode keeps one in flight: test_fp8_channel)
        assert entry["wgmma_waits"] == ([0] if entry["fp8_wgmma"] else []), entry
        assert entry["tma_loads"] == bool(entry["tiles"][5]), entry
        if entry["tiles"][5] and entry["tiles"][0] == 64:  # programs an SM by shared memory (228 KiB, 1 KiB each reserved)
            assert (232448 // (entry["shared"] + 1024)) >= (3 if entry["tiles"][6] == 3 else 2), entry


_WEIGHT_ONLY_SM90_COMPILE = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

kernel = fp8_triton._weight_only_gemm_kernel
names = list(kernel.arg_names)
constexprs = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "SCALE_BLOCK", "SPLIT_K", "PRECISION", "UPCAST", "ROUND_BF16"]
aligned = ["x_ptr", "w_ptr", "w_s_ptr", "out_ptr", "partial_ptr", "counter_ptr", "N", "K", "stride_xm", "stride_wn",
           "stride_om"]
attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
report = []
seen = set()
for rows in (16, 64, 128, 256):
    for tiles in fp8_triton.weight_only_candidates(rows, 4096):
        key = (tiles.block_m, tiles.block_n, min(tiles.split_k, 2), tiles.num_warps, tiles.num_stages)
        if key in seen:
            continue
        seen.add(key)
        types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", w_s_ptr="*fp32", out_ptr="*bf16", partial_ptr="*fp32",
                     counter_ptr="*i32")
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in names}
        values = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=128, SCALE_BLOCK=128,
                      SPLIT_K=key[2], PRECISION="tf32", UPCAST=False, ROUND_BF16=False)
        compiled = triton.compile(ASTSource(kernel, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
        path = os.path.join(sys.argv[1], "w%d_%d_%d.cubin" % key[:3])
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True,
                               text=True).stdout
        report.append(dict(tiles=list(key), ttgir_register_a="dot_op<{opIdx = 0" in compiled.asm["ttgir"],
                           wgmma=sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", compiled.asm["ptx"]))),
                           shared=compiled.metadata.shared, stack=int(re.search(r"STACK:(\d+)", usage).group(1))))
print(json.dumps(report))
"""


@needs_interpreter
def test_weight_only_tiles_compile_for_h200_on_register_fed_wgmma(tmp_path):
    """Every launch the weight-only plan chooses from, compiled for sm_90 by Triton's own ptxas (no GPU):
    Hopper's bf16 wgmma with the dequantized weight tile fed from registers (the swapped product's A
    operand: no shared-memory round trip), no register spills, and shared memory within the H200's
    227 KB a block."""
    import json
    import subprocess
    import sys

    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not os.path.exists(os.path.join(os.path.dirname(fp8_triton.triton.__file__), "backends", "nvidia", "bin",
                                       "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_BACKENDS_IN_TREE="1", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", _WEIGHT_ONLY_SM90_COMPILE, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    assert {entry["tiles"][0] for entry in report} == {16, 64, 128}
    for entry in report:
        block_m = entry["tiles"][0]
        assert entry["wgmma"] == [f"wgmma.mma_async.sync.aligned.m64n{block_m}k16.f32.bf16.bf16"], entry
        assert entry["ttgir_register_a"] and entry["stack"] == 0 and entry["shared"] <= 227 * 1024, entry


@needs_interpreter
@pytest.mark.parametrize("batch", [(3, 2), (3, 7)])  # 6 tokens: the fused kernel; 21: the two-kernel path
def test_triton_linear_interpreted_bf16_with_bias(batch):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(*batch, 256, dtype=torch.bfloat16)
    assert fp8.gemm_path("triton", batch[0] * batch[1], 96, 256, x.device) == ("fused" if batch == (3, 2) else "two_kernel")
    module = fp8.Fp8Linear(linear, "triton")
    triton_out = module(x)
    dequant_out = fp8.Fp8Linear(linear, "dequant")(x)
    assert triton_out.dtype == torch.bfloat16 and triton_out.shape == (*batch, 96)
    assert float((triton_out.float() - dequant_out.float()).norm() / dequant_out.float().norm()) < 0.06
    # the quantized-activation product itself, up to two bf16 roundings (the GEMM's output, then + bias)
    reference = fp8_numerics.reference_matmul(x.reshape(-1, 256), module.weight_fp8, module.weight_scale_inv, True) + linear.bias
    torch.testing.assert_close(triton_out.reshape(-1, 96).float(), reference, rtol=2**-6, atol=2**-6)


# ---------------------------------------------------------------------------------- the separate quantizer, the
# two-kernel GEMM, cuBLASLt's call and the dispatch table
def mma_tolerance(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per output element: ``2^-12 · (|x_q| @ |W_deq|ᵀ) + tiny``. Hopper's FP8 tensor cores (wgmma, and
    cuBLASLt's kernels on them) keep only ~14 bits of the running sum inside one K step (DeepSeek-V3
    technical report), so the error of a GEMM on the same quantized operands scales with the sum
    of the magnitudes it adds, not with the result: measured on the H200 up to 6.1e-5 of that sum
    (wgmma tiles) and 3.6e-8 (mma.sync, 16-row tiles), with bit-exact quantized inputs. A wrong scale
    or a dropped split-K partial moves an output by a sizeable part of that sum (see
    ``test_mma_tolerance_catches_wrong_scales_and_missing_splits``)."""
    q, s = fp8_numerics.quantize_activation(x)
    x_q = q.float() * s.repeat_interleave(fp8_numerics.BLOCK, dim=-1)[:, : x.shape[1]]
    magnitude = x_q.abs() @ fp8_numerics.dequantize_weight(values, scales, torch.float32).abs().T
    return magnitude * 2.0**-12 + 1e-12


def assert_within_mma_tolerance(out: torch.Tensor, reference: torch.Tensor, tolerance: torch.Tensor,
                                output_rounding: float = 0.0):
    """``|out - reference| <= tolerance + output_rounding · |reference|`` everywhere (``output_rounding``:
    2^-8 for a bf16 output, whose rounding is up to 2^-9 relative)."""
    error = (out.float() - reference).abs()
    bound = tolerance + output_rounding * reference.abs()
    worst = int((error / bound).argmax())
    assert bool((error <= bound).all()), (f"|out - reference| exceeds the MMA bound: worst element {worst}: "
                                          f"error {float(error.flatten()[worst]):.3e}, bound "
                                          f"{float(bound.flatten()[worst]):.3e}")


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
    reordered = sum(fp8_numerics.reference_matmul(x[:, k:k + 256], values[:, k:k + 256], scales[:, k // 128:(k + 256) // 128],
                                         quantize_inputs=True) for k in range(0, 1024, 256))
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


def _ties_and_random_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Even rows: e4m3 ties and their fp32 neighbours, each 128-channel group led by 448 (so its scale is
    exactly 1 and the cast's rounding decides every value); odd rows: random values over five decades."""
    generator = torch.Generator().manual_seed(seed)
    ties = _e4m3_ties()
    x = ties[torch.randint(len(ties), (rows, cols), generator=generator)]
    x[:, ::128] = 448.0
    random = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 2, cols)
    x[1::2] = random[1::2]
    return x


@needs_interpreter
@pytest.mark.parametrize("rows,cols,row_align", [(5, 300, 16), (16, 256, 16), (3, 128, 1), (17, 128, 16)])
def test_activation_quantizer_interpreted_is_bit_exact(rows, cols, row_align):
    """The separate quantizer (two-kernel and cuBLASLt paths) writes exactly ``fp8_numerics.quantize_activation``'s
    values and scales, ties included; padding rows are 0 with scale 1; the scales are group-major
    (strides ``(1, rows')``), the layout cuBLASLt's 1 x 128 scaling reads."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    x = _ties_and_random_rows(rows, cols, seed=rows + cols)
    values, scales = fp8_triton.quantize_activation(x.to(torch.bfloat16).float(), row_align=row_align)
    padded = -(-rows // row_align) * row_align
    assert values.shape == (padded, cols) and values.dtype == torch.float8_e4m3fn
    assert scales.shape == (padded, -(-cols // 128)) and scales.stride() == (1, padded)
    expected_values, expected_scales = fp8_numerics.quantize_activation(x.to(torch.bfloat16).float())
    assert torch.equal(values[:rows].float(), expected_values.float())  # (the interpreter's rounding writes -0 as +0)
    assert torch.equal(scales[:rows], expected_scales)
    assert not values[rows:].float().any() and bool((scales[rows:] == 1).all())


def _weight_blocks(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A weight whose first 128 rows (of each matrix) are e4m3 ties and their fp32 neighbours on even rows
    (``_ties_and_random_rows``: each block's scale ~1, the cast's rounding decides) and whose other blocks
    hold e4m3 ties and neighbours times a random scale per block, decades apart, led by 448 times it
    (in fp32, ``w / s`` lands next to a tie: the division's rounding decides)."""
    generator = torch.Generator().manual_seed(seed)
    *lead, rows, cols = shape
    ties = _e4m3_ties()
    weight = ties[torch.randint(len(ties), shape, generator=generator)]
    weight[..., ::128, ::128] = 448.0
    blocks = torch.rand((*lead, -(-rows // 128), -(-cols // 128)), generator=generator) * 10.0 ** torch.randint(
        -4, 3, (*lead, -(-rows // 128), -(-cols // 128)), generator=generator).float()
    weight *= blocks.repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(128, -1)[..., :cols]
    weight[..., :128, :] = _ties_and_random_rows(min(rows, 128), cols, seed)
    return weight


@needs_interpreter
@pytest.mark.parametrize("shape,dtype", [((200, 300), torch.float32), ((256, 384), torch.bfloat16),
                                         ((3, 130, 257), torch.bfloat16), ((2, 256, 384), torch.float32)])
def test_weight_quantizer_interpreted_is_bit_exact(shape, dtype):
    """``fp8_triton.quantize_weight_into`` (one launch, the FP8 weight update's quantizer on CUDA) writes
    ``fp8_quantize.quantize_weight``'s torch numbers: ragged edges (zero padding: the amax of the block's real
    values), all-zero blocks (scale 1), e4m3 ties, scales far from 1 (where ``w · (1/s)`` instead of a
    correctly rounded ``w / s`` would differ: checked to differ on this data), stacked experts."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    weight = _weight_blocks(shape, seed=sum(shape)).to(dtype)
    weight[..., 128:, :128] = 0  # an all-zero block (where there are rows past 128)
    expected_values, expected_scales = fp8_numerics._quantize_weight_torch(weight)
    values = torch.empty_like(expected_values)
    scales = torch.full_like(expected_scales, float("nan"))
    fp8_triton.quantize_weight_into(weight, values, scales)
    assert torch.equal(values.float(), expected_values.float())  # (the interpreter's rounding writes -0 as +0)
    assert torch.equal(scales, expected_scales)
    if shape[-2] > 128:
        assert bool((scales[..., 1, 0] == 1).all())
    if dtype == torch.float32:  # the data tells a correctly rounded division from a product with 1 / s
        blocks = scales.repeat_interleave(128, -2)[..., :shape[-2], :].repeat_interleave(128, -1)[..., :shape[-1]]
        approximate = (weight * (1 / blocks)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert not torch.equal(approximate.float(), expected_values.float())


@needs_interpreter
def test_weight_quantizer_interpreted_writes_into_views_and_reads_strided_rows():
    """A weight update quantizes straight into the engine's storage: a fused projection's rows (a row
    slice of values and scales) and one expert's matrix (an index into a stack), from an incoming tensor
    with a row stride (a column slice of a wider one). Only the target's elements change."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    wide = _weight_blocks((256, 640), seed=3)
    weight = wide[:, 64:64 + 384]  # row stride 640
    assert weight.stride() == (640, 1)
    expected_values, expected_scales = fp8_numerics._quantize_weight_torch(weight)
    storage = torch.full((512, 384), 3.0).to(torch.float8_e4m3fn)
    storage_scales = torch.full((4, 3), 7.0)
    fp8_triton.quantize_weight_into(weight, storage[128:384], storage_scales[1:3])
    assert torch.equal(storage[128:384].float(), expected_values.float())
    assert torch.equal(storage_scales[1:3], expected_scales)
    assert bool((storage[:128].float() == 3).all() and (storage[384:].float() == 3).all())
    assert bool((storage_scales[0] == 7).all() and (storage_scales[3] == 7).all())
    experts = torch.zeros((3, 256, 384), dtype=torch.float8_e4m3fn)
    expert_scales = torch.zeros((3, 2, 3))
    fp8_triton.quantize_weight_into(weight, experts[1], expert_scales[1])
    assert torch.equal(experts[1].float(), expected_values.float()) and torch.equal(expert_scales[1], expected_scales)
    assert not experts[0].float().any() and not experts[2].float().any()
    # transformers' fused experts [E, 2I, H]: the up half of every expert at once (the update of
    # ...experts.gate_up_proj), a 3-d input whose experts lie 2I rows apart
    fused = _weight_blocks((3, 2 * 130, 257), seed=4)
    up = fused[:, 130:]
    expected_values, expected_scales = fp8_numerics._quantize_weight_torch(up)
    up_values, up_scales = torch.empty_like(expected_values), torch.empty_like(expected_scales)
    fp8_triton.quantize_weight_into(up, up_values, up_scales)
    assert torch.equal(up_values.float(), expected_values.float()) and torch.equal(up_scales, expected_scales)
    with pytest.raises(ValueError, match="does not fit"):
        fp8_triton.quantize_weight_into(weight, storage[:200], storage_scales[:2])


@needs_interpreter
@pytest.mark.parametrize("rows,out_features,in_features,tiles", [
    (20, 200, 300, None),  # planned tiles, ragged N and K
    (40, 96, 640, (64, 32, 3)),  # 5 K steps over 3 splits
    (130, 40, 256, (128, 256)),  # two row tiles, one ragged
])
def test_two_kernel_gemm_interpreted_equals_reference(rows, out_features, in_features, tiles):
    """``quantize_first``: the activations quantized by the separate kernel, the GEMM on e4m3 A and its
    group-major scales; the same numbers as the fused kernel's reference."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-2, 1, in_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    values, scales = fp8_quantize.quantize_weight(weight)
    out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles and _tiles(*tiles),
                                       quantize_first=True)
    reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


@needs_interpreter
@pytest.mark.parametrize("rows,out_features,in_features,tiles", [
    (20, 200, 640, None),  # planned TMA tiles, ragged N, rows fewer than the tile
    (40, 96, 640, (64, 32, 3)),  # 5 K steps over 3 splits
    (130, 40, 256, (128, 256)),  # two row tiles, one ragged; one tile wider than the weight
    (70, 384, 1024, (64, 128, 2)),  # three rows of weight blocks, split K
])
def test_two_kernel_gemm_by_tma_equals_pointer_loads(monkeypatch, rows, out_features, in_features, tiles):
    """The two-kernel GEMM loading its tiles by TMA descriptors (out-of-bounds rows and columns read as
    zeros) gives the pointer-load kernel's bits and the reference's numbers."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=generator) * torch.logspace(-2, 1, in_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    values, scales = fp8_quantize.quantize_weight(weight)
    assert fp8_triton.tma_usable(fp8_triton.quantize_activation(x)[0], values)
    tiles = tiles and _tiles(*tiles)
    by_tma = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles, quantize_first=True)
    monkeypatch.setattr(fp8_triton, "USE_TMA", False)
    by_pointers = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32,
                                               tiles=tiles or fp8_triton.plan_tma_tiles(rows, out_features,
                                                                                        in_features, x.device),
                                               quantize_first=True)
    assert torch.equal(by_tma, by_pointers)
    reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
    torch.testing.assert_close(by_tma, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


def test_tma_usable_needs_16_byte_rows():
    """TMA reads rows whose byte stride and base are multiples of 16: K = 300 e4m3 channels are not, so
    that GEMM keeps pointer loads (it still runs: the interpreted reference test above has K = 300)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if fp8_triton.TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    aligned = torch.zeros(4, 320, dtype=fp8_numerics.FP8_DTYPE)
    ragged = torch.zeros(4, 300, dtype=fp8_numerics.FP8_DTYPE)
    interpreting = fp8_triton._interpreting()
    assert fp8_triton.tma_usable(aligned, aligned) is interpreting  # a CPU tensor: only under the interpreter
    assert not fp8_triton.tma_usable(ragged, ragged)
    assert not fp8_triton.tma_usable(aligned, ragged)


def test_tma_tiles_plan_matches_the_h200_sweeps():
    """``plan_tma_tiles`` picks what the H200 sweeps found best, or the launches measured next to it:
    up to 128 tokens session 21's sweep of every candidate on Qwen3-0.6B/1.7B/4B (64-column tiles
    unless 128-column ones fill the GPU, K split only where too few programs or > 20 K steps, 5 stages
    unsplit); to 256 the same with <= 40 K steps (session 22's sweep at 256); above, session 20's
    (128 columns). On every Qwen3 shape: the split's programs and K steps as the rule says, never
    more splits than K steps allow."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    plan, tiles = fp8_triton._planned_tma_tiles, fp8_triton.Tiles
    # (rows, out, in): the sweep's best launch (bench/results/fp8_gemm-nvidia-h200-20261204-sweep-s21c.json)
    assert plan(32, 4096, 1024, 132) == tiles(64, 64, 1, 4, 5)  # 0.6B qkv: 6.3 us (session 20's plan 10.4)
    assert plan(64, 1024, 2048, 132) == tiles(64, 64, 4, 4, 4)  # 0.6B o: 8.3 (11.6)
    assert plan(32, 1024, 3072, 132) == tiles(64, 64, 4, 4, 4)  # 0.6B down: 8.8 (11.9)
    assert plan(32, 4096, 2048, 132) == tiles(64, 64, 1, 4, 5)  # 1.7B qkv: 8.8 (11.7)
    assert plan(32, 12288, 2048, 132) == tiles(64, 128, 1, 4, 4)  # 1.7B gate_up: 13.7 with 5 stages (this 13.8)
    assert plan(64, 2048, 6144, 132) == tiles(64, 64, 4, 4, 4)  # 1.7B down: 12.2 with 5 stages (15.3)
    assert plan(64, 6144, 2560, 132) == tiles(64, 64, 1, 4, 5)  # 4B qkv: 10.8 (12.9)
    assert plan(32, 2560, 4096, 132) == tiles(64, 64, 2, 4, 4)  # 4B o: 12.2 (12.6)
    assert plan(128, 2560, 9728, 132) == tiles(64, 64, 4, 4, 4)  # 4B down: 20.6 (22.8)
    assert plan(128, 19456, 2560, 132) == tiles(64, 128, 1, 4, 3)  # 4B gate_up: 23.7, session 20's plan
    # 129-256 tokens (bench/results/fp8_gemm-nvidia-h200-20261204-sweep-s22.json at 256; session 20's
    # rule in brackets): the output projection unsplit in 64 columns, the MLP's down split in two
    assert plan(256, 1024, 2048, 132) == tiles(64, 64, 1, 4, 5)  # 0.6B o: 8.4 us, the best (11.0)
    assert plan(256, 2048, 2048, 132) == tiles(64, 64, 1, 4, 5)  # 1.7B o: 9.1, the best (11.4)
    assert plan(256, 2048, 6144, 132) == tiles(64, 64, 2, 4, 4)  # 1.7B down: 17.5, the best (18.0)
    assert plan(256, 6144, 2560, 132) == tiles(64, 128, 1, 4, 4)  # 4B qkv: 14.4, the best (as planned)
    assert plan(256, 19456, 2560, 132) == tiles(64, 128, 1, 4, 3)  # 4B gate_up: 36.0, the best (as planned)
    # above 256 tokens: session 20's rule, 128 columns
    assert plan(512, 2560, 9728, 132) == tiles(64, 128, 2, 4, 3)
    assert plan(512, 2560, 4096, 132) == tiles(64, 128, 1, 4, 4)
    assert plan(8, 1024, 1024, 132).block_m == 16
    for hidden, intermediate, q_out, kv_out in [(1024, 3072, 2048, 1024), (2048, 6144, 2048, 1024),
                                                (2560, 9728, 4096, 1024)]:
        for out_features, in_features in [(q_out + 2 * kv_out, hidden), (hidden, q_out), (2 * intermediate, hidden),
                                          (hidden, intermediate)]:
            for rows in (17, 64, 128, 256, 512):
                planned = plan(rows, out_features, in_features, 132)
                decode = rows <= fp8_triton.TMA_MID_MAX_ROWS
                steps = -(-in_features // 128)
                row_tiles = -(-rows // planned.block_m)
                programs = row_tiles * -(-out_features // planned.block_n) * planned.split_k
                wide = row_tiles * -(-out_features // 128) >= 0.7 * 132
                assert planned.block_n == (128 if wide or not decode else 64), (rows, out_features, planned)
                assert planned.split_k == 1 or steps >= 2 * planned.split_k, planned
                enough, most = ((33, 20 if rows <= fp8_triton.TMA_DECODE_MAX_ROWS else 40) if decode else (66, 40))
                assert (programs >= enough and -(-steps // planned.split_k) <= most) or planned.split_k == 8 \
                    or steps < 4 * planned.split_k, (rows, out_features, in_features, planned)
                if planned.split_k > 1:  # the split before it was not enough
                    fewer = programs // 2
                    assert fewer < enough or -(-steps // (planned.split_k // 2)) > most, planned
                if planned.block_n == 64:
                    assert planned.num_stages == (5 if planned.split_k == 1 else 4)
                else:
                    assert planned.num_stages == (4 if programs <= 264 else 3)


def _strict_scaled_mm(calls: list):
    """A stand-in for ``torch._scaled_mm`` that enforces its DeepSeek-style (1x128, 128x128) contract
    as PyTorch's ScaledBlas.cpp checks it (see fp8_cublas.py) and computes the scaled product in fp32."""

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
        m, k = a.shape
        n = b.shape[1]
        groups = -(-k // 128)
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert a.stride(1) == 1 and b.stride(0) == 1, "row-major a, column-major b (TN)"
        assert k % 16 == 0 and n % 16 == 0, "K and N divisible by 16"
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.shape == (m, groups) and (scale_a.stride(0), groups == 1 or scale_a.stride(1) == m) == (1, True), \
            f"scale_a must be ({m}, {groups}) outer-dim-major, got {scale_a.shape} {scale_a.stride()}"
        assert scale_b.shape == (groups, -(-n // 128)) and scale_b.t().is_contiguous(), \
            f"scale_b must be ({groups}, {-(-n // 128)}) with a row-major transpose, got {scale_b.shape} {scale_b.stride()}"
        calls.append((m, n, k))
        a_full = a.float() * scale_a.repeat_interleave(128, dim=1)[:, :k]
        b_full = b.float() * scale_b.repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
        return (a_full @ b_full).to(out_dtype)

    return scaled_mm


@needs_interpreter
def test_cublas_path_calls_scaled_mm_by_its_contract_and_falls_back_for_other_shapes(monkeypatch, caplog):
    """On the CPU, with ``torch._scaled_mm`` replaced by a strict check of its block-scaled contract:
    ``fp8_cublas.block_matmul`` passes the layouts cuBLASLt reads (tokens padded to 16, scales
    outer-dim-major, the weight and its scales as transposed views) and slices the padding away; an
    ``Fp8Linear`` on ``cublas`` takes this path for a shape cuBLASLt takes and, saying so once, the
    two-kernel Triton path for one it does not."""
    import logging

    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _strict_scaled_mm(calls))
    monkeypatch.setattr(fp8_cublas, "available", lambda device: True)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(5, 512, generator=generator)
    weight = torch.randn(144, 512, generator=generator) / 23  # N = 144: one ragged row of weight blocks
    values, scales = fp8_quantize.quantize_weight(weight)
    out = fp8_cublas.block_matmul(x, values, scales, torch.float32)
    assert out.shape == (5, 144) and calls == [(16, 144, 512)]
    torch.testing.assert_close(out, fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True), rtol=1e-5,
                               atol=1e-6)
    linear = nn.Linear(512, 144, bias=False)
    linear.weight.data.copy_(weight)
    module = fp8.Fp8Linear(linear, "cublas")
    assert fp8.gemm_path("cublas", 3, 144, 512, x.device) == "cublas"
    torch.testing.assert_close(module(x[:3]), out[:3], rtol=1e-5, atol=1e-6)
    assert len(calls) == 2
    ragged = fp8.Fp8Linear(nn.Linear(300, 200, bias=False), "cublas")  # K = 300: not whole 128-channel groups
    with caplog.at_level(logging.INFO, logger=fp8.__name__):
        y = torch.randn(3, 300, generator=generator)
        torch.testing.assert_close(ragged(y), fp8_numerics.reference_matmul(y, ragged.weight_fp8, ragged.weight_scale_inv,
                                                                   quantize_inputs=True), rtol=1e-5, atol=1e-6)
        ragged(y)
    assert len(calls) == 2
    assert [r.getMessage() for r in caplog.records if "[200 x 300]" in r.getMessage()] == [
        "fp8 GEMM [200 x 300] weight: cuBLASLt's block-scaled FP8 GEMM takes N % 16 == 0 and K % 512 == 0; "
        "this shape uses the two-kernel Triton GEMM"]


@needs_interpreter
def test_cublas_check_gemm_catches_a_refused_or_misread_recipe(monkeypatch):
    """``fp8_cublas.check_block_matmul`` (run once per GPU before cuBLASLt is used): passes the strict
    stand-in of ``torch._scaled_mm``; reports a library that refuses the recipe, and one that reads a
    scale layout differently (activation scales taken token-major, or the weight scales untransposed)."""
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "_scaled_mm", _strict_scaled_mm([]))
    assert fp8_cublas.check_block_matmul(cpu) is None

    def refusing(*args, **kwargs):
        raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90")

    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    assert "refused the block-scaled GEMM: NotImplementedError: DeepSeek style" in fp8_cublas.check_block_matmul(cpu)
    strict = _strict_scaled_mm([])
    misreads = {"token-major activation scales": lambda a, b, scale_a, scale_b, **kw: strict(
                    a, b, scale_a.contiguous().view(scale_a.shape[1], -1).t(), scale_b, **kw),
                "untransposed weight scales": lambda a, b, scale_a, scale_b, **kw: strict(
                    a, b, scale_a, scale_b.contiguous().view(scale_b.shape[1], -1).t(), **kw)}
    for name, misread in misreads.items():
        monkeypatch.setattr(torch, "_scaled_mm", misread)
        assert "differs from fp8.reference_matmul" in fp8_cublas.check_block_matmul(cpu), name


def test_warm_up_runs_one_gemm_per_launch_and_covers_every_token_count(monkeypatch):
    """``fp8_install.warm_up`` runs one GEMM per distinct compiled launch (shape x path x tiles) of the
    linears and routed experts, once per shape however many layers or experts share it (an expert's
    gate and up are one shape), and after it every token count up to the
    limit maps to a launch it ran — so no decode bucket or prefill compiles mid-rollout; far fewer
    GEMMs than token counts (the token count is not specialized on)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if fp8_triton.triton is None:
        pytest.skip("needs triton (the tile planners)")
    calls = []
    monkeypatch.setattr(fp8_triton, "available", lambda device: True)
    accumulating = []  # the two-kernel launches' epilogue-add variant (fused_ops' residual in the down GEMM)
    monkeypatch.setattr(fp8_install, "fp8_linear", lambda x, values, scales, bias, backend, accumulate_into=None: (
        accumulating if accumulate_into is not None else calls).append((x.shape[0], *values.shape)))
    class Experts(nn.Module):  # transformers' fused routed-experts layout: 4 experts, I = 384, H = 256
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 768, 256) / 16)
            self.down_proj = nn.Parameter(torch.randn(4, 256, 384) / 16)
            self.act_fn = nn.SiLU()

    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.ModuleDict({"up": nn.Linear(256, 1024, bias=False), "down": nn.Linear(1024, 256, bias=False),
                       "experts": Experts()})
        for _ in range(3))})
    weights = fp8_install.quantize_model(model, "triton")
    assert len(weights.experts) == 3
    count, _ = fp8_install.warm_up(weights, max_rows=600)
    assert count == len(calls) and len({(rows, n, k) for rows, n, k in calls}) == len(calls)
    shapes = [(1024, 256), (256, 1024), (384, 256), (256, 384)]  # linears; experts' gate = up, down
    assert {(n, k) for _, n, k in calls} == set(shapes)
    cpu = torch.device("cpu")
    tma = fp8_triton.tma_usable_for(weights.linears["layers.0.up"].weight_fp8)  # under the interpreter: TMA
    for n, k in shapes:
        ran = {fp8_triton.launch_key(fp8.gemm_path("triton", rows, n, k, cpu), rows, n, k, cpu, tma)
               for rows, cn, ck in calls if (cn, ck) == (n, k)}
        needed = {fp8_triton.launch_key(fp8.gemm_path("triton", rows, n, k, cpu), rows, n, k, cpu, tma)
                  for rows in range(1, 601)}
        assert needed == ran
        assert len(ran) < 60
        two_kernel = {(rows, cn, ck) for rows, cn, ck in calls
                      if (cn, ck) == (n, k) and fp8.gemm_path("triton", rows, n, k, cpu) == "two_kernel"}
        assert two_kernel and two_kernel == {call for call in accumulating if call[1:] == (n, k)}
    calls.clear()
    monkeypatch.setattr(fp8_triton, "available", lambda device: False)  # no Triton path: nothing to compile
    assert fp8_install.warm_up(weights, max_rows=600)[0] == 0 and not calls


@needs_interpreter
def test_warm_up_interpreted_runs_the_real_gemms():
    """Unmocked, under Triton's interpreter: ``warm_up`` launches the real kernels (fused up to 16
    tokens, the TMA two-kernel GEMM above, split K where planned) once per launch, shared by the
    layers of one shape, and the model computes the same afterwards."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    torch.manual_seed(0)
    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.ModuleDict({"up": nn.Linear(256, 384, bias=False), "down": nn.Linear(384, 256, bias=False)})
        for _ in range(2))})
    x = torch.randn(70, 256)
    weights = fp8_install.quantize_model(model, "triton")
    before = model["layers"][1]["down"](model["layers"][0]["up"](x))
    count, _ = fp8_install.warm_up(weights, max_rows=80)
    cpu = torch.device("cpu")
    expected = {(n, k, *fp8_triton.launch_key(fp8.gemm_path("triton", rows, n, k, cpu), rows, n, k, cpu, True))
                for n, k in [(384, 256), (256, 384)] for rows in range(1, 81)}
    assert count == len(expected) and 4 <= count <= 8  # per shape: the fused launch and one or two TMA launches
    assert torch.equal(model["layers"][1]["down"](model["layers"][0]["up"](x)), before)


def test_gemm_dispatch_table(monkeypatch):
    """``GEMM_DISPATCH``: every backend's ranges end open; auto takes the fused W8A8 kernel up to 16
    tokens, the two-kernel one up to 256 and above cuBLASLt where it runs and the shape qualifies (every
    Qwen3 linear does), else the two-kernel GEMM; weight_only is weight-only at every size (the H200's
    per-path timings, in fp8.py)."""
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    for backend, ranges in fp8.GEMM_DISPATCH.items():
        assert backend in fp8.GEMM_BACKENDS and ranges[-1][0] is None
        assert all(path in fp8.GEMM_PATHS for _, path in ranges)
    assert set(fp8.GEMM_DISPATCH) == set(fp8.GEMM_BACKENDS)
    expected = {"auto": ["fused", "fused", "two_kernel", "two_kernel", "two_kernel", "cublas", "cublas"],
                "weight_only": ["weight_only"] * 7,
                "triton": ["fused", "fused", "two_kernel", "two_kernel", "two_kernel", "two_kernel", "two_kernel"],
                "cublas": ["cublas"] * 7, "dequant": ["dequant"] * 7}
    for backend, paths in expected.items():
        assert [fp8.dispatch_path(backend, rows) for rows in (1, 16, 17, 128, 256, 257, 2048)] == paths, backend
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fp8_cublas, "available", lambda device: True)
    for out_features, in_features in [(2048, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (1024, 3072),
                                      (4096, 2560), (2560, 4096), (9728, 2560), (2560, 9728), (6144, 2048)]:
        assert fp8.gemm_path("auto", 2048, out_features, in_features, cuda) == "cublas"
        assert fp8.gemm_path("auto", 8, out_features, in_features, cuda) == "fused"
    assert fp8.gemm_path("auto", 2048, 200, 1024, cuda) == "two_kernel"  # N % 16
    assert fp8.gemm_path("auto", 2048, 1024, 384, cuda) == "two_kernel"  # K % 512
    monkeypatch.setattr(fp8_cublas, "available", lambda device: False)
    assert fp8.gemm_path("auto", 2048, 2048, 1024, cuda) == "two_kernel"
    assert fp8.gemm_path("cublas", 1, 2048, 1024, cuda) == "two_kernel"
    with pytest.raises(ValueError, match=r"--fp8-gemm-backend cublas .* cannot run here: it needs a CUDA device"):
        fp8.resolve_backend("cublas", torch.device("cpu"))


# ---------------------------------------------------------------------------------- the model runner
@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    return {q: ModelRunner(tiny_model_dir, num_slots=2, slot_capacity=64, quantization=q) for q in (None, "fp8")}


def test_decoder_linears_are_quantized_the_rest_is_not(runners):
    model = runners["fp8"].model
    kinds = {name.rsplit(".", 1)[-1] for name in runners["fp8"].fp8.linears}
    # gate/up (384 rows each: whole 128-row blocks) are one fused FP8 GEMM; q/k/v (k, v: 64 rows) stay apart,
    # since a block across two parts would make a part's update re-quantize its neighbour's rows
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert len(runners["fp8"].fp8.linears) == 6 * model.config.num_hidden_layers
    assert runners["fp8"].fused_projections == {"qkv": 0, "gate_up": model.config.num_hidden_layers}
    assert sorted(runners["fp8"].fp8.parts) == sorted(f"model.layers.{i}.mlp.{p}" for i in
                                                      range(model.config.num_hidden_layers) for p in ("gate_proj", "up_proj"))
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.float32
    # the decoder's linears shrink from 4 bytes (fp32 here) to 1 byte + a scale per 16384 elements
    linear_elements = sum(m.weight_fp8.numel() for m in runners["fp8"].fp8.linears.values())
    saved = runners[None].weight_bytes() - runners["fp8"].weight_bytes()
    assert 3 * linear_elements * 0.99 < saved < 3 * linear_elements, (saved, linear_elements)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight",  # [64, 128]: one ragged row of blocks
                                  "model.layers.1.mlp.up_proj.weight"])  # rows 384..768 of the fused gate_up
def test_get_weight_answers_the_dequantized_weight(runners, name):
    full, quantized = runners[None].get_weight(name), runners["fp8"].get_weight(name)
    assert quantized.shape == full.shape and quantized.dtype == torch.float32
    assert not torch.equal(quantized, full)
    values, scales = fp8_quantize.quantize_weight(full)
    assert torch.equal(quantized, fp8_numerics.dequantize_weight(values, scales))


def test_a_fused_part_updates_only_its_own_blocks(runners):
    runner = runners["fp8"]
    fused = runner.fp8.linears["model.layers.0.mlp.gate_up_proj"]
    values_before, scales_before = fused.weight_fp8.clone(), fused.weight_scale_inv.clone()
    gate = runner.get_weight("model.layers.0.mlp.gate_proj.weight").clone()
    new = torch.randn(gate.shape, generator=torch.Generator().manual_seed(7)) * 0.05
    assert runner.load_named_tensors([("model.layers.0.mlp.gate_proj.weight", new)]) == 1
    expected_values, expected_scales = fp8_quantize.quantize_weight(new)
    assert torch.equal(fused.weight_fp8[:384].view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(fused.weight_scale_inv[:3], expected_scales)
    # up_proj's rows and scales are untouched
    assert torch.equal(fused.weight_fp8[384:].view(torch.uint8), values_before[384:].view(torch.uint8))
    assert torch.equal(fused.weight_scale_inv[3:], scales_before[3:])
    # and the layer computes with the new gate: the fused GEMM's gate columns are x @ dequant(new)ᵀ
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(fused(x)[:, :384], x @ fp8_numerics.dequantize_weight(expected_values, expected_scales).T)
    runner.load_named_tensors([("model.layers.0.mlp.gate_proj.weight", gate)])


def test_weight_update_quantizes_by_name_and_refuses_bad_names(runners):
    runner = runners["fp8"]
    name = "model.layers.0.mlp.down_proj.weight"
    original = runner.get_weight(name).clone()
    new = torch.randn(original.shape, generator=torch.Generator().manual_seed(5)) * 0.02
    storage = runner.fp8.linears["model.layers.0.mlp.down_proj"].weight_fp8
    before = storage.data_ptr()
    assert runner.load_named_tensors([(name, new.to(torch.bfloat16))]) == 1
    expected = fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(new.to(torch.bfloat16)))
    assert torch.equal(runner.get_weight(name), expected)
    assert storage.data_ptr() == before  # updated in place: captured CUDA graphs stay valid
    with pytest.raises(ValueError, match=r"expected shape \(128, 384\)"):
        runner.load_named_tensors([(name, new.T.contiguous())])
    with pytest.raises(KeyError, match="not a parameter"):
        runner.load_named_tensors([("model.layers.0.mlp.nope_proj.weight", new)])
    runner.load_named_tensors([(name, original)])


def test_disk_update_is_quantized(runners, tiny_model_dir, tmp_path):
    from engine_test_utils import copy_with_weights, perturbed_state_dict

    state = perturbed_state_dict(tiny_model_dir, seed=2)
    new_dir = copy_with_weights(tiny_model_dir, tmp_path / "new", state)
    runner = runners["fp8"]
    runner.load_from_disk(str(new_dir))
    name = "model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(runner.get_weight(name), fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(state[name])))
    assert torch.equal(runner.get_weight("model.norm.weight"), state["model.norm.weight"])
    runner.load_from_disk(tiny_model_dir)


def test_moe_experts_are_quantized_and_updated_by_checkpoint_and_fused_names(tiny_deepseek_v3_dir):
    from slime.backends.embedded_engine.model_runner import ModelRunner

    from engine_test_utils import load_hf
    from slime.backends.embedded_engine.model_runner import ForwardRow

    runner = ModelRunner(tiny_deepseek_v3_dir, num_slots=2, slot_capacity=64, quantization="fp8")
    assert runner.fp8.experts, "the routed experts were not quantized"
    # the FP8 experts route and compute like transformers' fp32 ones, up to the FP8 rounding
    prompt = PROMPTS[2] + PROMPTS[0]
    _, (logits,) = runner.forward([0], [ForwardRow(prompt, 0, want_all_logits=True)])
    with torch.no_grad():
        reference = load_hf(tiny_deepseek_v3_dir)(torch.tensor([prompt])).logits[0]
    gap = (torch.log_softmax(logits, -1) - torch.log_softmax(reference, -1)).abs().mean()
    print(f"DeepSeek-V3 fp8 vs fp32: mean log-prob gap {float(gap):.4f}")
    assert 1e-5 < float(gap) < MAX_MEAN_LOGPROB_GAP, float(gap)
    prefix = next(iter(runner.fp8.experts))
    assert not any(name.endswith("kv_b_proj") for name in runner.fp8.linears)  # absorbed MLA reads it as a matrix
    assert not any(name.endswith(".gate") for name in runner.fp8.linears)
    # the graph-capturable dense form (every expert, zero weight where not routed) equals the routed loop
    experts = runner.fp8.experts[prefix]
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, experts.gate_fp8.shape[-1], generator=generator)
    picks = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=generator)
    torch.testing.assert_close(experts.dense_forward(hidden, picks, weights),
                               experts.routed_forward(hidden, picks, weights), rtol=1e-5, atol=1e-6)
    gate = runner.get_weight(f"{prefix}.3.gate_proj.weight")
    new_gate = torch.randn(gate.shape, generator=torch.Generator().manual_seed(0)) * 0.05
    runner.load_named_tensors([(f"{prefix}.3.gate_proj.weight", new_gate)])
    assert torch.equal(runner.get_weight(f"{prefix}.3.gate_proj.weight"),
                       fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(new_gate)))
    fused = runner.get_weight(f"{prefix}.gate_up_proj")
    assert torch.equal(fused[3, :gate.shape[0]], runner.get_weight(f"{prefix}.3.gate_proj.weight"))
    new_fused = torch.randn(fused.shape, generator=torch.Generator().manual_seed(1)) * 0.05
    runner.load_named_tensors([(f"{prefix}.gate_up_proj", new_fused)])
    half = fused.shape[1] // 2
    assert torch.equal(runner.get_weight(f"{prefix}.5.up_proj.weight"),
                       fp8_numerics.dequantize_weight(*fp8_quantize.quantize_weight(new_fused[5, half:])))
    with pytest.raises(ValueError, match="expected shape"):
        runner.load_named_tensors([(f"{prefix}.gate_up_proj", new_fused[:, :half])])


# ---------------------------------------------------------------------------------- the engine's decode
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [100, 200, 300, 400, 500], [42]]
# Measured on the tiny model (fp32, 4 prompts x 16 greedy tokens): mean |engine - HF fp32| log-prob gap
# 0.011 (max 0.023) with fp8 weights, every greedy token equal; block scales off by 2x give 0.15. The
# tiny model's weights are alike in every block, so subtler breaks (one scale per tensor, no scale at
# all) stay near 0.02 here: the block math tests above are what catch those.
MAX_MEAN_LOGPROB_GAP = 0.05


def _engine_greedy(runner, prompts, n=16) -> list[tuple[list[int], list[float]]]:
    """Greedy outputs (tokens, log-probs) of the engine's scheduler and decode loop over ``runner``."""
    import threading

    from slime.backends.embedded_engine.engine import Engine
    from slime.backends.embedded_engine.io_struct import GenerateRequest, SamplingParams

    engine = Engine(runner, chunked_prefill_size=64)
    engine.start()
    try:
        waits = []
        for i, prompt in enumerate(prompts):
            done = threading.Event()
            request = GenerateRequest(rid=f"fp8-{i}", input_ids=prompt,
                                      params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            seq = engine.call(lambda r=request, d=done: engine.add_request(
                r, lambda s, finished, d=d: finished and d.set())).result(30)
            waits.append((seq, done))
        for _, done in waits:
            assert done.wait(120)
        return [(list(seq.output_ids), list(seq.output_logprobs)) for seq, _ in waits]
    finally:
        engine.stop()


def test_fp8_engine_greedy_decode_stays_close_to_fp32(runners, tiny_model_dir):
    from engine_test_utils import hf_greedy, hf_logprobs, load_hf

    hf = load_hf(tiny_model_dir)
    gaps, agree, total = [], 0, 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, _engine_greedy(runners["fp8"], PROMPTS)):
        reference = hf_greedy(hf, prompt, len(tokens))
        # tokens agree until the first flip (after it the continuations differ by construction)
        first_flip = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
        agree, total = agree + first_flip, total + len(tokens)
        gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens, 1.0))]
    mean_gap = sum(gaps) / len(gaps)
    print(f"fp8 vs fp32: mean log-prob gap {mean_gap:.4f}, max {max(gaps):.4f}, tokens before a flip {agree}/{total}")
    assert 1e-4 < mean_gap < MAX_MEAN_LOGPROB_GAP, mean_gap  # quantized (not fp32), and close to it
    assert agree >= total // 2, (agree, total)


def _greedy(http, prompt, n=16):
    response = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    out = response.json()
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]


# ---------------------------------------------------------------------------------- CUDA (skipped without it)
@pytest.mark.gpu
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 200, 300), (128, 1024, 1024), (77, 3072, 1024),
                                                           (128, 1024, 3072), (300, 64, 384), (2048, 3072, 1024)])
def test_gpu_triton_gemm_equals_reference(rows, out_features, in_features):
    """The compiled kernels (the GPU's own e4m3 cast, the planned tiles, split K where planned; fused and
    two-kernel) against the torch reference: fp32 output within the tensor cores' accumulation error
    (:func:`mma_tolerance`), bf16 up to its rounding."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator).cuda().to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).cuda()
    values, scales = fp8_quantize.quantize_weight(weight)
    reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
    tolerance = mma_tolerance(x, values, scales)
    print(rows, out_features, in_features, fp8_triton.plan_tiles(rows, out_features, in_features, x.device))
    for quantize_first in (False, True):
        for tiles in (None, _tiles(16, 32, 4), _tiles(64, 256, 2, 8), _tiles(128, 128, 1, 8)):
            out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles,
                                               quantize_first=quantize_first)
            assert_within_mma_tolerance(out, reference, tolerance)
    out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.bfloat16)
    assert float((out.float() - reference).norm() / reference.norm()) < 4e-3  # the bf16 output rounding
    exact = x.float() @ weight.T
    assert float((out.float() - exact).norm() / exact.norm()) < 0.06


@pytest.mark.gpu
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 200, 300), (16, 6144, 1024), (77, 3072, 1024),
                                                           (128, 19456, 2560), (128, 2560, 9728), (300, 64, 384),
                                                           (2048, 3072, 1024)])
def test_gpu_weight_only_gemm_equals_the_dequantized_matmul(rows, out_features, in_features):
    """The compiled weight-only kernel (the planned tiles and a few others, split K included) against
    the dequant path's product: fp32 output to summation order, bf16 up to its rounding."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).cuda()
    values, scales = fp8_quantize.quantize_weight(weight)
    print(rows, out_features, in_features, fp8_triton.plan_weight_only(rows, out_features, in_features,
                                                                        torch.device("cuda")))
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, in_features, generator=generator).cuda().to(dtype)
        reference = _weight_only_reference(x, values, scales)
        tiles_list = [None, fp8_triton.WeightOnlyTiles(16, 64, 4), fp8_triton.WeightOnlyTiles(64, 128, 2),
                      fp8_triton.WeightOnlyTiles(128, 128, 1, 8, 2)]
        for tiles in tiles_list:
            out = fp8_triton.weight_only_matmul(x, values, scales, tiles=tiles)
            if dtype == torch.float32:  # fp32 dots in full precision (ieee), not tf32
                torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))
            else:
                error = (out.float() - reference).abs()
                assert bool((error <= reference.abs() * 2.0**-8 + 1e-3 * float(reference.abs().max())).all()), tiles


@pytest.mark.gpu
def test_gpu_weight_only_split_k_replays_in_a_cuda_graph():
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(0)
    values, scales = fp8_quantize.quantize_weight((torch.randn(1024, 2048, generator=generator) / 45).cuda())
    x = torch.randn(64, 2048, generator=generator).cuda().to(torch.bfloat16)
    tiles = fp8_triton.WeightOnlyTiles(64, 64, 4)
    fp8_triton.weight_only_matmul(x, values, scales, tiles=tiles)  # compile, counters: not in capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_triton.weight_only_matmul(x, values, scales, tiles=tiles)
    for seed in range(3):
        x.copy_(torch.randn(64, 2048, generator=torch.Generator().manual_seed(seed + 1)).cuda())
        graph.replay()
        reference = _weight_only_reference(x, values, scales)
        assert bool(((out.float() - reference).abs() <= reference.abs() * 2.0**-8 + 1e-3).all())


@pytest.mark.gpu
@pytest.mark.parametrize("rows,out_features,in_features", [(128, 6144, 2560), (128, 2560, 9728), (77, 3072, 1024),
                                                           (256, 19456, 2560), (20, 200, 640)])
def test_gpu_two_kernel_gemm_by_tma_equals_pointer_loads(monkeypatch, rows, out_features, in_features):
    """Compiled: the TMA two-kernel GEMM (its planned tiles, split K where planned, replayed in a CUDA
    graph on new inputs) gives the pointer-load kernel's bits for the same tiles, within the tensor
    cores' accumulation error of the reference."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(rows)
    values, scales = fp8_quantize.quantize_weight((torch.randn(out_features, in_features, generator=generator)
                                          / in_features**0.5).cuda())
    x = torch.randn(rows, in_features, generator=generator).cuda().to(torch.bfloat16)
    assert fp8_triton.tma_usable(fp8_triton.quantize_activation(x)[0], values)
    tiles = fp8_triton.plan_tma_tiles(rows, out_features, in_features, x.device)
    fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, quantize_first=True)  # compile, counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, quantize_first=True)
    for seed in range(2):
        x.copy_(torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed + 1)).cuda())
        graph.replay()
        reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
        assert_within_mma_tolerance(out, reference, mma_tolerance(x, values, scales))
        with monkeypatch.context() as patch:
            patch.setattr(fp8_triton, "USE_TMA", False)
            by_pointers = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles,
                                                       quantize_first=True)
        assert torch.equal(out, by_pointers), tiles


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "weight_only"])
def test_gpu_warm_up_leaves_nothing_to_compile(backend):
    """After ``fp8_install.warm_up``, a GEMM of any token count up to the limit finds its kernel compiled: the
    JIT caches of the FP8 kernels do not grow (an argument that varies with the batch, specialized
    on, would add a compile mid-rollout)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    kernels = [fp8_triton._fp8_gemm_kernel, fp8_triton._quantize_activation_kernel,
               fp8_triton._weight_only_gemm_kernel]
    if not all(hasattr(kernel, "device_caches") for kernel in kernels):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")

    def compiled() -> int:
        return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())

    torch.manual_seed(0)
    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.ModuleDict({"up": nn.Linear(1024, 3072, bias=False), "down": nn.Linear(3072, 1024, bias=False)})
        for _ in range(2))}).cuda().to(torch.bfloat16)
    weights = fp8_install.quantize_model(model, fp8.resolve_backend(backend, torch.device("cuda")))
    fp8_install.warm_up(weights, max_rows=300)
    before = compiled()
    layer = model["layers"][0]
    for rows in range(1, 301):
        layer["down"](layer["up"](torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)))
    assert compiled() == before


@pytest.mark.gpu
def test_gpu_split_k_gemm_replays_in_a_cuda_graph():
    """A split-K launch captured in a CUDA graph: its counters reset themselves, so every replay (new
    inputs, same buffers) reduces correctly."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(1024, 2048, generator=generator) / 45).cuda()
    values, scales = fp8_quantize.quantize_weight(weight)
    x = torch.randn(64, 2048, generator=generator).cuda().to(torch.bfloat16)
    tiles = _tiles(64, 64, 4)
    fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles)  # compile, counters: not in capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles)
    for seed in range(3):
        x.copy_(torch.randn(64, 2048, generator=torch.Generator().manual_seed(seed + 1)).cuda())
        graph.replay()
        reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
        assert_within_mma_tolerance(out, reference, mma_tolerance(x, values, scales))


@pytest.mark.gpu
def test_gpu_activation_quantizer_is_bit_exact():
    """The compiled quantizer (the GPU's own fp32 -> e4m3 cast; the fused GEMM quantizes with the same
    code) writes exactly ``fp8_numerics.quantize_activation``'s values and scales, e4m3 ties and their fp32
    neighbours included: no MMA in between, so no tolerance. One difference is allowed, the sign of a
    zero: the kernel's fma correction of ``x / s`` turns -0 into +0 (measured on the H200: the only 32
    of 78,848 values that differed), which no product can tell apart."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    x = _ties_and_random_rows(77, 1024, seed=0).cuda()
    for source in (x, x.to(torch.bfloat16)):
        values, scales = fp8_triton.quantize_activation(source, row_align=16)
        expected_values, expected_scales = fp8_numerics.quantize_activation(source)
        got = values[:77]
        same_bits = got.view(torch.uint8) == expected_values.view(torch.uint8)
        both_zero = (got.float() == 0) & (expected_values.float() == 0)
        assert bool((same_bits | both_zero).all()), int((~(same_bits | both_zero)).sum())
        assert int(same_bits.sum()) > 0.99 * got.numel()
        assert torch.equal(scales[:77], expected_scales)


_WEIGHT_QUANTIZER_SM90_COMPILE = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
kernel = fp8_triton._quantize_weight_kernel
out = []
for dtype in ("bf16", "fp32"):
    types = dict(w_ptr="*" + dtype, q_ptr="*fp8e4nv", s_ptr="*fp32", fp8_max="fp32")
    sig = {n: "constexpr" if n in ("CHUNK", "EMULATE_E4M3_CAST") else types.get(n, "i32") for n in kernel.arg_names}
    consts = dict(CHUNK=fp8_triton.WEIGHT_QUANTIZE_CHUNK, EMULATE_E4M3_CAST=False)
    c = triton.compile(ASTSource(kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=fp8_triton.WEIGHT_QUANTIZE_WARPS))
    path = os.path.join(sys.argv[1], f"quantize_weight_{dtype}.cubin")
    open(path, "wb").write(c.asm["cubin"])
    usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    ptx = c.asm["ptx"]
    out.append(dict(dtype=dtype, cast="cvt.rn.satfinite.e4m3x2.f32" in ptx, div_rn="div.rn.f32" in ptx,
                    regs=int(re.search(r"REG:(\d+)", usage).group(1)), stack=int(re.search(r"STACK:(\d+)", usage).group(1))))
print(json.dumps(out))
"""


@needs_interpreter
def test_weight_quantizer_compiles_for_h200(tmp_path):
    """The weight quantizer compiled for sm_90 by Triton's own ptxas without a GPU (bf16 and fp32
    weights): the GPU's e4m3 cast, the correctly rounded division, no spills, and few enough registers
    that >= 4 programs (16 warps) share an SM (a bandwidth-bound kernel needs loads in flight)."""
    import json
    import subprocess
    import sys

    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not os.path.exists(os.path.join(os.path.dirname(fp8_triton.triton.__file__), "backends", "nvidia", "bin",
                                       "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_BACKENDS_IN_TREE="1", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", _WEIGHT_QUANTIZER_SM90_COMPILE, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    assert [entry["dtype"] for entry in report] == ["bf16", "fp32"]
    for entry in report:
        assert entry["cast"] and entry["div_rn"] and entry["stack"] == 0, entry
        assert 65536 // (entry["regs"] * 32 * fp8_triton.WEIGHT_QUANTIZE_WARPS) >= 4, entry


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((19456, 2560), torch.bfloat16), ((2560, 9728), torch.bfloat16),
                                         ((1000, 1000), torch.float32), ((8, 768, 2048), torch.bfloat16)])
def test_gpu_weight_quantizer_is_bit_exact(shape, dtype):
    """The compiled weight quantizer (``fp8_quantize.quantize_weight`` on CUDA, every FP8 weight update) writes
    the bits of the torch version (the GPU's own e4m3 cast; in fp32 next to ties, its division):
    Qwen3-4B's gate_up and down, a ragged matrix, a stack of experts."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    weight = _weight_blocks(shape, seed=len(shape)).to(dtype).cuda()
    expected_values, expected_scales = fp8_numerics._quantize_weight_torch(weight)
    values, scales = fp8_quantize.quantize_weight(weight)  # dispatches to the kernel on CUDA
    assert fp8_quantize._triton_quantizes(weight) and fp8_triton.available(weight.device)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(scales, expected_scales)


def _needs_cublas():
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    if not fp8_cublas.available(torch.device("cuda")):
        pytest.skip("cuBLASLt's block-scaled FP8 GEMM needs sm_90 and a torch built with CUDA >= 12.9")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 2048, 1024), (16, 1024, 1024), (77, 3072, 1024),
                                                           (128, 1024, 3072), (2048, 6144, 2048), (5, 2560, 9728)])
def test_gpu_cublas_gemm_equals_reference(rows, out_features, in_features):
    """cuBLASLt's block-scaled GEMM (``torch._scaled_mm``, 1x128 activations x 128x128 weights) after the
    separate quantizer, on Qwen3 shapes: within the tensor cores' accumulation error of the reference
    plus the bf16 output's rounding, and as close to the unquantized product as the Triton path."""
    _needs_cublas()
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator).cuda().to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).cuda()
    values, scales = fp8_quantize.quantize_weight(weight)
    assert fp8.gemm_path("cublas", rows, out_features, in_features, x.device) == "cublas"
    reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
    out = fp8_cublas.block_matmul(x, values, scales, torch.bfloat16)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    assert_within_mma_tolerance(out, reference, mma_tolerance(x, values, scales), output_rounding=2.0**-8)
    exact = x.float() @ weight.T
    assert float((out.float() - exact).norm() / exact.norm()) < 0.06


@pytest.mark.gpu
def test_gpu_cublas_gemm_replays_in_a_cuda_graph():
    """The quantizer + ``torch._scaled_mm`` pair captured in a CUDA graph (no host sync): every replay on
    new inputs in the same buffer gives the new product."""
    _needs_cublas()
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(1024, 2048, generator=generator) / 45).cuda()
    values, scales = fp8_quantize.quantize_weight(weight)
    x = torch.randn(64, 2048, generator=generator).cuda().to(torch.bfloat16)
    fp8_cublas.block_matmul(x, values, scales, torch.bfloat16)  # compile the quantizer, pick the cuBLASLt algorithm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_cublas.block_matmul(x, values, scales, torch.bfloat16)
    for seed in range(3):
        x.copy_(torch.randn(64, 2048, generator=torch.Generator().manual_seed(seed + 1)).cuda())
        graph.replay()
        reference = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True)
        assert_within_mma_tolerance(out, reference, mma_tolerance(x, values, scales), output_rounding=2.0**-8)


def check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(model_dir, tmp_path, quantization, backend):
    """A CUDA engine serving ``model_dir`` with ``--quantization`` / ``--fp8-gemm-backend``: greedy log-probs
    within twice the CPU bound of HF fp32's, before and after an update from disk — which lands in place, so
    the decode CUDA graphs captured before it serve the new weights."""
    import httpx
    from engine_test_utils import copy_with_weights, hf_logprobs, load_hf, perturbed_state_dict
    from slime.backends.embedded_engine.serving.launch import running_engine

    hf = load_hf(model_dir)
    state = perturbed_state_dict(model_dir, seed=3)
    perturbed = load_hf(model_dir)
    perturbed.load_state_dict(state)
    with running_engine(model_dir, extra_args=["--device", "cuda", "--context-length", "256",
                                               "--max-running-requests", "8", "--quantization", quantization,
                                               "--fp8-gemm-backend", backend]) as proc, \
            httpx.Client(base_url=proc.url, timeout=120) as http:
        for model in (hf, perturbed):
            gaps = []
            for prompt in PROMPTS:
                tokens, logprobs = _greedy(http, prompt)
                gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(model, prompt, tokens, 1.0))]
            mean_gap = sum(gaps) / len(gaps)
            print(f"{quantization} {backend}: mean log-prob gap vs HF fp32 {mean_gap:.4f}")
            assert mean_gap < 2 * MAX_MEAN_LOGPROB_GAP, mean_gap  # bf16 activations on top of fp8 weights
            if model is hf:
                copy_with_weights(model_dir, tmp_path / "perturbed", state)
                assert http.post("/update_weights_from_disk",
                                 json={"model_path": str(tmp_path / "perturbed")}).json()["success"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["weight_only", "triton", "auto", "dequant"])
def test_gpu_fp8_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, backend):
    check_engine_decodes_close_to_fp32_and_updates_under_cuda_graphs(tiny_model_dir, tmp_path, "fp8", backend)


@pytest.fixture(scope="module")
def cublas_sized_model_dir(tmp_path_factory):
    """A tiny Qwen3 whose every linear is a shape cuBLASLt's block-scaled GEMM takes (hidden 512,
    intermediate 1024, 8 x 64 query and 4 x 64 key/value heads: K in {512, 1024}, N in {256, 512, 1024})."""
    from slime.utils import tiny_model

    sizes = dict(tiny_model.SIZES, cublas=tiny_model.TinyModelSize(512, 2, 8, 4, 64, 1024, 1024))
    original, tiny_model.SIZES = tiny_model.SIZES, sizes
    try:
        return str(tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny_cublas"), size="cublas", seed=0))
    finally:
        tiny_model.SIZES = original


@pytest.mark.gpu
def test_gpu_fp8_engine_decodes_with_the_cublas_backend(cublas_sized_model_dir):
    """An engine serving ``--fp8-gemm-backend cublas`` under CUDA graphs decodes close to HF fp32; every
    linear of the model is one cuBLASLt takes (so the engine's GEMMs are cuBLASLt's, not the fallback)."""
    _needs_cublas()
    import httpx
    from engine_test_utils import hf_logprobs, load_hf
    from slime.backends.embedded_engine.serving.launch import running_engine

    hf = load_hf(cublas_sized_model_dir)
    linears = [m for name, m in hf.named_modules() if isinstance(m, nn.Linear) and ".layers." in name]
    assert linears and all(fp8.gemm_path("cublas", 8, m.out_features, m.in_features, torch.device("cuda")) == "cublas"
                           for m in linears)
    with running_engine(cublas_sized_model_dir, extra_args=["--device", "cuda", "--context-length", "256",
                                                           "--max-running-requests", "8", "--quantization", "fp8",
                                                           "--fp8-gemm-backend", "cublas"]) as proc, \
            httpx.Client(base_url=proc.url, timeout=120) as http:
        gaps = []
        for prompt in PROMPTS:
            tokens, logprobs = _greedy(http, prompt)
            gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens, 1.0))]
        assert http.get("/get_server_info").json()["internal_states"][0]["cuda_graph_captures"] > 0
    mean_gap = sum(gaps) / len(gaps)
    print(f"cublas fp8 on CUDA: mean log-prob gap vs HF fp32 {mean_gap:.4f}")
    assert mean_gap < 2 * MAX_MEAN_LOGPROB_GAP, mean_gap


@pytest.mark.gpu
def test_gpu_fp8_moe_engine_decodes_through_cuda_graphs(tiny_deepseek_v3_dir):
    """FP8 routed experts switch to their dense form while a decode step is captured (no host sync)."""
    import httpx
    from engine_test_utils import hf_logprobs, load_hf
    from slime.backends.embedded_engine.serving.launch import running_engine

    hf = load_hf(tiny_deepseek_v3_dir)
    with running_engine(tiny_deepseek_v3_dir, extra_args=["--device", "cuda", "--context-length", "256",
                                                          "--max-running-requests", "8", "--quantization", "fp8"]) as proc, \
            httpx.Client(base_url=proc.url, timeout=120) as http:
        gaps = []
        for prompt in PROMPTS:
            tokens, logprobs = _greedy(http, prompt)
            gaps += [abs(a - b) for a, b in zip(logprobs, hf_logprobs(hf, prompt, tokens, 1.0))]
        assert http.get("/get_server_info").json()["internal_states"][0]["cuda_graph_captures"] > 0
    mean_gap = sum(gaps) / len(gaps)
    print(f"DeepSeek-V3 fp8 on CUDA: mean log-prob gap vs HF fp32 {mean_gap:.4f}")
    assert mean_gap < 2 * MAX_MEAN_LOGPROB_GAP, mean_gap


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_silu_kernels_quantize_their_output_like_the_quantizer(dtype):
    """``fused_ops``' RMSNorm, residual add + RMSNorm and SiLU gate with ``quantize=True`` return the same
    output and, beside it, exactly ``fp8_numerics.quantize_activation`` of that output (values and group-major
    scales): the FP8 GEMM that reads them computes what it would after its own quantize launch."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton
    from slime.backends.embedded_engine.kernels import fused_ops

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 384, generator=generator) * torch.logspace(-2, 2, 384)).to(dtype)
    residual = torch.randn(5, 384, generator=generator).to(dtype)
    weight = torch.randn(384, generator=generator).to(dtype)

    def assert_quantized(out, quantized):
        values, scales = quantized
        want_values, want_scales = fp8_triton.quantize_activation(out)  # the quantize launch it replaces
        assert scales.shape == want_scales.shape and scales.stride() == want_scales.stride()  # group-major
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(scales, want_scales)
        torch_values, torch_scales = fp8_numerics.quantize_activation(out)  # and torch's numbers (-0.0 comes out +0.0)
        assert torch.equal(values.float(), torch_values.float()) and torch.equal(scales, torch_scales)

    out, quantized = fused_ops.rms_norm(x, weight, 1e-6, quantize=True)
    assert torch.equal(out, fused_ops.rms_norm(x, weight, 1e-6))
    assert_quantized(out, quantized)
    normed, total, quantized = fused_ops.add_rms_norm(x, residual, weight, 1e-6, quantize=True)
    want_normed, want_total = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(normed, want_normed) and torch.equal(total, want_total)
    assert_quantized(normed, quantized)
    gate_up = torch.randn(5, 2 * 1280, generator=generator).to(dtype)  # 1280 = one full and one partial block
    act, quantized = fused_ops.silu_mul_packed(gate_up, quantize=True)
    assert torch.equal(act, fused_ops.silu_mul_packed(gate_up))
    assert_quantized(act, quantized)
    with pytest.raises(ValueError, match="128-channel groups"):
        fused_ops.rms_norm(x[:, :320], weight[:320], 1e-6, quantize=True)


@needs_interpreter
@pytest.mark.parametrize("tiles", [None, (64, 128, 3)])
def test_two_kernel_gemm_takes_quantized_activations_and_accumulates_in_its_epilogue(tiles):
    """``w8a8_block_matmul(quantized=...)`` equals the two-kernel GEMM that quantizes first (bit for
    bit), and ``accumulate_into`` adds the product to the given tensor in place — the fp32 sum of the
    product and the old values (split K included: the last program adds them once)."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 768, generator=generator)
    values, scales = fp8_quantize.quantize_weight(torch.randn(256, 768, generator=generator) / 28)
    tiles = tiles and _tiles(*tiles)
    plain = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles, quantize_first=True)
    given = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles,
                                         quantized=fp8_triton.quantize_activation(x))
    assert torch.equal(given, plain)
    residual = torch.randn(40, 256, generator=generator)
    target = residual.clone()
    out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, tiles=tiles, quantize_first=True,
                                       accumulate_into=target)
    assert out is target and torch.equal(target, plain + residual)
    with pytest.raises(ValueError, match="accumulate_into"):
        fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32, accumulate_into=residual[:, :128])


def swap_in_fused_layer_forwards(model) -> None:
    """``fused_ops.install``'s forward swaps (decoder layer, RMSNorm, packed MLP), which it makes on CUDA only."""
    import types

    from slime.backends.embedded_engine.kernels import fused_ops

    for module in model.modules():
        name = type(module).__name__
        if name in fused_ops.DECODER_LAYER_CLASSES:
            module.forward = types.MethodType(fused_ops._decoder_layer_forward, module)
        elif name in fused_ops.RMSNORM_CLASSES:
            module.forward = types.MethodType(fused_ops._rmsnorm_forward, module)
        elif name in fused_ops.MLP_CLASSES:
            module.forward = types.MethodType(fused_ops._packed_mlp_forward, module)
    fused_ops.link_layers(model)


@needs_interpreter
@pytest.mark.parametrize("tokens", [20, 6])
def test_fp8_decoder_layers_with_quantizing_producers_equal_the_plain_path(monkeypatch, tokens):
    """A tiny Qwen3 under FP8 (``triton`` backend, fp32) through ``fused_ops``' decoder-layer forward:
    with ``FP8_QUANT_IN_PRODUCER`` the RMSNorms and the SiLU gate hand each projection its e4m3
    activations and the MLP's residual add runs in the down GEMM's epilogue — the logits are the same
    bits as without (20 tokens: the two-kernel GEMM; 6: the fused kernel, where nothing is handed over)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kernels import fused_projections

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    assert fused_projections.install(model, row_multiple=128) == {"qkv": 2, "gate_up": 2}
    weights = fp8_install.quantize_model(model, "triton")
    swap_in_fused_layer_forwards(model)
    offered, epilogue = [], []
    linear_forward = fp8.Fp8Linear.forward

    def spy(self, x, accumulate_into=None):
        offered.append(self._offered is not None and self._offered[0] is x)
        epilogue.append(accumulate_into is not None)
        return linear_forward(self, x, accumulate_into=accumulate_into)

    monkeypatch.setattr(fp8.Fp8Linear, "forward", spy)
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = model(ids).logits
        handed, added = sum(offered), sum(epilogue)
        monkeypatch.setattr(fused_ops, "FP8_QUANT_IN_PRODUCER", False)
        offered.clear(), epilogue.clear()
        plain = model(ids).logits
    assert sum(offered) == 0 and sum(epilogue) == 0
    # per layer: q/k/v, gate/up and down take handed-over activations, down adds the residual (o does not)
    assert (handed, added) == ((6, 2) if tokens > 16 else (0, 0))
    assert len(weights.linears) == 8
    assert torch.equal(fused, plain)


_PRODUCERS_SM90_COMPILE = r"""
import json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from slime.backends.embedded_engine.kernels import fused_ops
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
out = []
silu_token = dict(gu_ptr="*bf16", out_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", fp8_max="fp32")
cases = [("_rmsnorm_kernel", dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", eps="fp32", fp8_max="fp32"), 4096, 8),
         ("_add_rmsnorm_kernel", dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", sum_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", xs_ptr="*fp32", cs_ptr="*fp32", eps="fp32", fp8_max="fp32"), 4096, 8),
         ("_silu_mul_packed_kernel", dict(gu_ptr="*bf16", out_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", fp8_max="fp32"), 1024, 4),
         # the 4B gate's 9728 columns held whole (the launch silu_mul_packed makes), and a longer row in slices
         ("_silu_mul_packed_token_kernel", silu_token, fused_ops.SILU_TOKEN_ONE_PASS, 16),
         ("_silu_mul_packed_token_kernel", silu_token, fused_ops.SILU_TOKEN_BLOCK, 4)]
for name, types, block, warps in cases:
    kernel = getattr(fused_ops, name)
    names = list(kernel.arg_names)
    consts = ["BLOCK", "QUANT", "ONE_PASS", "EMULATE_E4M3_CAST", "SCALED_X"]
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    # none, per 128-channel group, per token (the norms; the SiLU gate's per-token kernel is its own, always 2);
    # the residual add + RMSNorm also reading an unscaled FP8 product (w8a8_fp8's cublas backend: quant 3 here)
    for quant in ((2,) if "token" in name else (0, 1) if "silu" in name else (0, 1, 2, 3) if "add" in name
                  else (0, 1, 2)):
        token = dict(ONE_PASS=block == fused_ops.SILU_TOKEN_ONE_PASS)
        norm = dict(QUANT=min(quant, 2), **(dict(SCALED_X=quant == 3) if "add" in name else {}))
        values = dict(BLOCK=block, EMULATE_E4M3_CAST=False, **(token if "token" in name else norm))
        c = triton.compile(ASTSource(kernel, sig, values, {}),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        path = os.path.join(sys.argv[1], f"{name}_{quant}_{block}.cubin")
        open(path, "wb").write(c.asm["cubin"])
        usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        out.append(dict(kernel=name, quant=quant, cast="cvt.rn.satfinite.e4m3x2.f32" in c.asm["ptx"],
                        regs=int(re.search(r"REG:(\d+)", usage).group(1)), stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                        shared=c.metadata.shared))
print(json.dumps(out))
"""


@needs_interpreter
def test_producer_quantizing_kernels_compile_for_h200(tmp_path):
    """The RMSNorm, residual add + RMSNorm and SiLU gate kernels with ``QUANT`` (their output's e4m3
    activations for the FP8 GEMM: per 128-channel group, and per token for ``w8a8_fp8``), compiled
    for sm_90 by Triton's own ptxas without a GPU, at the 4B model's widths: the GPU's own e4m3 cast, no
    register spills; without ``QUANT`` no cast at all."""
    import json
    import subprocess
    import sys

    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not os.path.exists(os.path.join(os.path.dirname(fp8_triton.triton.__file__), "backends", "nvidia", "bin",
                                       "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_BACKENDS_IN_TREE="1", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", _PRODUCERS_SM90_COMPILE, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 11
    for entry in report:
        assert entry["stack"] == 0 and entry["cast"] == (entry["quant"] > 0), entry

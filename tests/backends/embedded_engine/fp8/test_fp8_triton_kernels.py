"""The Triton kernels of block-wise FP8 (``fp8/triton_kernels.py``): the fused, weight-only and two-kernel GEMMs
against their references, e4m3 rounding at ties, the activation and weight quantizers bit for bit, the tile and
TMA plans, the quantizing norms and SiLU gate, and sm_90 compiles.

The Triton tests run on the CPU only under Triton's interpreter: ``bash scripts/test.sh`` runs them a second
time with ``PYTHONPATH=.venv/triton-interpreter TRITON_INTERPRET=1``; on CUDA the ``gpu`` tests run the
compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from slime.backends.embedded_engine.fp8 import block as fp8
from slime.backends.embedded_engine.fp8 import numerics as fp8_numerics
from slime.backends.embedded_engine.fp8 import quantize as fp8_quantize
from fp8_test_utils import _SM90_COMPILE, assert_within_mma_tolerance, mma_tolerance, needs_interpreter


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
    away_reference = fp8_numerics.reference_matmul(away, w_values, w_scales, quantize_inputs=True)
    assert not torch.allclose(away_reference, reference, **tolerance)


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
    reference = (fp8_numerics.reference_matmul(x.reshape(-1, 256), module.weight_fp8, module.weight_scale_inv, True)
                 + linear.bias)
    torch.testing.assert_close(triton_out.reshape(-1, 96).float(), reference, rtol=2**-6, atol=2**-6)


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

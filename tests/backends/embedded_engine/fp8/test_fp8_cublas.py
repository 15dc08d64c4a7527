"""cuBLASLt's block-scaled FP8 GEMM (``fp8/cublas.py``): the ``torch._scaled_mm`` call by its layout contract
against a strict stand-in, the once-per-GPU check GEMM, and on a Hopper GPU the GEMM, its CUDA graph replay and
the engine on the ``cublas`` backend."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slime.backends.embedded_engine.fp8 import block as fp8
from slime.backends.embedded_engine.fp8 import numerics as fp8_numerics
from slime.backends.embedded_engine.fp8 import quantize as fp8_quantize
from fp8_test_utils import (MAX_MEAN_LOGPROB_GAP, PROMPTS, _greedy, assert_within_mma_tolerance, mma_tolerance,
                            needs_interpreter)


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
        reference = fp8_numerics.reference_matmul(y, ragged.weight_fp8, ragged.weight_scale_inv, quantize_inputs=True)
        torch.testing.assert_close(ragged(y), reference, rtol=1e-5, atol=1e-6)
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

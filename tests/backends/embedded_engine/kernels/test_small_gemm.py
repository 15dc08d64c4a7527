"""The small-M Triton GEMM of decode steps (small_gemm.py) against torch, under Triton's interpreter
(scripts/test.sh runs these with TRITON_INTERPRET=1) and on the GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Scratch buffers start as NaN: a sum over a split not yet written shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)


def _reference(x, weight, bias=None, residual=None, gate=False):
    x = x.double()
    if gate:
        g, u = x.chunk(2, dim=-1)
        x = (torch.nn.functional.silu(g) * u).to(weight.dtype).double()  # rounded once, as the kernel does
    out = x @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    if residual is not None:
        out = out + residual.double()
    return out


@needs_interpreter
@pytest.mark.parametrize("rows,out_features,in_features,split_k", [
    (1, 96, 256, None), (5, 200, 300, None), (16, 64, 1024, 3), (16, 130, 384, 1), (7, 256, 512, 4)])
@pytest.mark.parametrize("variant", ["plain", "bias", "residual_in_place", "gate"])
def test_small_gemm_interpreted_equals_torch(rows, out_features, in_features, split_k, variant, poisoned_empty):
    """Ragged N and K, planned and explicit K splits (uneven: 8 K steps over 3), bias, the residual
    added into ``out`` in place, the SiLU gate prologue: fp32 results equal the float64 product to
    fp32 rounding; the tickets are back at 0 and a second call gives the same bits."""
    from slime.backends.embedded_engine.kernels import small_gemm

    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    width = 2 * in_features if variant == "gate" else in_features
    x = torch.randn(rows, width, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    bias = torch.randn(out_features, generator=gen) if variant == "bias" else None
    residual = torch.randn(rows, out_features, generator=gen) if variant == "residual_in_place" else None
    expected = _reference(x, weight, bias, residual, gate=variant == "gate")
    results = []
    for _ in range(2):
        out = residual.clone() if residual is not None else None
        got = small_gemm.linear(x, weight, bias, residual=out, out=out, gate=variant == "gate", split_k=split_k)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
        results.append(got)
    assert torch.equal(results[0], results[1])
    tickets = small_gemm._tickets.by_device.get(torch.device("cpu"))
    assert tickets is None or int(tickets.abs().sum()) == 0


@needs_interpreter
def test_small_gemm_interpreted_bf16_rounds_once():
    """bf16 in and out: one rounding of the fp32 sum (bias and residual added before it)."""
    from slime.backends.embedded_engine.kernels import small_gemm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 512, generator=gen).bfloat16()
    weight = (torch.randn(192, 512, generator=gen) / 20).bfloat16()
    bias, residual = torch.randn(192, generator=gen).bfloat16(), torch.randn(9, 192, generator=gen).bfloat16()
    got = small_gemm.linear(x, weight, bias, residual=residual)
    expected = _reference(x, weight, bias, residual).float()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.bfloat16().float(), atol=2 ** -7, rtol=2 ** -7)


def test_small_gemm_plan_fills_the_gpu_for_qwen3_decode_shapes():
    """About two programs per SM on 132 SMs for Qwen3-0.6B's four decoder linears, none with an empty split."""
    pytest.importorskip("triton")
    from slime.backends.embedded_engine.kernels import small_gemm

    for out_features, in_features in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]:
        split = small_gemm.plan(out_features, in_features, 132)
        tiles = -(-out_features // small_gemm.BLOCK_N)
        k_steps = -(-in_features // small_gemm.BLOCK_K)
        per_split = -(-k_steps // split)
        assert (split - 1) * per_split < k_steps  # every split has K steps
        assert 132 <= tiles * split <= 4 * 132, (out_features, in_features, split)


def test_small_gemm_refuses_what_it_does_not_take():
    pytest.importorskip("triton")
    from slime.backends.embedded_engine.kernels import small_gemm

    with pytest.raises(ValueError, match="at most 16 rows"):
        small_gemm.linear(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="gated: twice that expected"):
        small_gemm.linear(torch.zeros(2, 8), torch.zeros(4, 8), gate=True)


@needs_interpreter
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_with_small_m_linears_interpreted_keeps_the_logits(family, monkeypatch):
    """The decoder layers as :func:`fused_ops.install` binds them with the small-M GEMM switched on
    (q/k/v, o, gate/up through it; the down projection with its SiLU gate and the residual in its
    prologue/epilogue), 2 x 8 tokens: the logits equal the unpatched model's."""
    import types

    from slime.backends.embedded_engine.kernels import fused_ops
    from slime.backends.embedded_engine.kernels import fused_projections
    from slime.backends.embedded_engine.kernels import small_gemm
    from test_fused_projections import _models

    reference, patched = _models(family)
    fused_projections.install(patched)
    calls = []
    original = small_gemm.linear

    def counted(*args, **kwargs):
        calls.append(kwargs.get("gate", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(small_gemm, "linear", counted)
    monkeypatch.setattr(small_gemm, "ENABLED", True)
    for layer in patched.model.layers:
        layer.forward = types.MethodType(fused_ops._decoder_layer_forward, layer)
        layer.mlp.forward = types.MethodType(fused_ops._packed_mlp_forward, layer.mlp)
        for linear in layer.modules():
            if isinstance(linear, torch.nn.Linear):  # as install() picks them: fused projections too
                linear.forward = types.MethodType(fused_ops._small_m_linear_forward, linear)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    layers = len(patched.model.layers)
    # qkv, o, gate_up + the gated down; the tiny Llama's MLP has biases: its down projection runs plainly (with bias)
    gated = {"llama": 0, "qwen3": layers}[family]
    assert calls.count(True) == gated and calls.count(False) == 4 * layers - gated


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemm_on_gpu_equals_torch(dtype):
    """Compiled: Qwen3-0.6B's decode shapes at 1, 7 and 16 rows (planned splits), with the gate and the
    in-place residual, against torch (fp32: to rounding; bf16: within two bf16 roundings of fp64), also
    replayed in a CUDA graph."""
    from slime.backends.embedded_engine.kernels import small_gemm

    if not (torch.cuda.is_available() and small_gemm.available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")
    gen = torch.Generator().manual_seed(1)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    for out_features, in_features, gate in [(4096, 1024, False), (1024, 2048, False), (6144, 1024, False),
                                            (1024, 3072, True)]:
        weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).to("cuda", dtype)
        for rows in (1, 7, 16):
            x = torch.randn(rows, 2 * in_features if gate else in_features, generator=gen).to("cuda", dtype)
            residual = torch.randn(rows, out_features, generator=gen).to("cuda", dtype)
            expected = _reference(x, weight, None, residual, gate=gate)
            out = residual.clone()
            small_gemm.linear(x, weight, residual=out, out=out, gate=gate)
            torch.testing.assert_close(out.double(), expected, atol=tol * 4, rtol=tol)
    x = torch.randn(16, 1024, generator=gen).to("cuda", dtype)
    weight = torch.randn(4096, 1024, generator=gen).to("cuda", dtype) / 32
    eager = small_gemm.linear(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = small_gemm.linear(x, weight)
    for _ in range(3):
        graph.replay()
        torch.testing.assert_close(captured, eager, atol=0, rtol=0)  # fixed split order: the same bits

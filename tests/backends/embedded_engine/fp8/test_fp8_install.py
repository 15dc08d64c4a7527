"""``fp8/install.py``'s warm-up: one GEMM per distinct compiled launch, every token count covered, and (under
the interpreter, or on a GPU) the real kernels, leaving nothing to compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slime.backends.embedded_engine.fp8 import block as fp8
from slime.backends.embedded_engine.fp8 import install as fp8_install
from fp8_test_utils import needs_interpreter


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

"""Helpers shared by the FP8 tests: the interpreter mark, the MMA tolerance, the sm_90 compile script, and the
engine-level greedy decode checks used by both the block-wise and the per-channel tests."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slime.backends.embedded_engine.fp8 import numerics as fp8_numerics


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernels on the CPU: needs TRITON_INTERPRET=1 and an importable triton")


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


def _greedy(http, prompt, n=16):
    response = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    out = response.json()
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]


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

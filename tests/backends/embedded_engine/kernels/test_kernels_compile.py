"""The engine's decode kernels compiled for sm_90 without a GPU (Triton's bundled ptxas): the
interpreter runs Python, so a kernel that only the compiler rejects (a value whose type changes inside
an ``if``, an unsupported cast) passes the interpreter tests and breaks on the H200. Each variant the
engine launches is compiled here: bf16 and FP8 caches, with and without the fused cache write, split
and single-split attention with the in-kernel merge, one query token a row (decode) and a verify step's
T tokens, the small-M GEMM's prologue/epilogue variants, the sampler's kernels, the per-token FP8 quantizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from slime.backends.embedded_engine.fp8 import channel as fp8_channel
from slime.backends.embedded_engine.kernels import fused_ops
from slime.backends.embedded_engine.kernels import sampling_kernel
from slime.backends.embedded_engine.kernels import small_gemm
from slime.backends.embedded_engine.kernels import triton_attention

def compile_one(kernel, types, constexprs, num_warps=4, num_stages=1):
    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=num_stages))

done = []
for cache, saturate in (("bf16", False), ("fp8e4nv", True), ("fp8e5", True)):
    # without and with the fused cache write; with it also reading an unscaled FP8 product (w8a8_fp8's cublas backend)
    for write, scaled in ((False, False), (True, False), (True, True)):
        types = dict(qkv_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_ptr="*bf16",
                     k_ptr="*bf16", keys_ptr=f"*{cache}", values_ptr=f"*{cache}", slots_ptr="*i64",
                     positions_ptr="*i64", eps="fp32", k_inv_scale="fp32", v_inv_scale="fp32", limit="fp32",
                     rs_ptr="*fp32", cs_ptr="*fp32")
        compile_one(fused_ops._qk_norm_rope_kernel, types, dict(HALF=64, NORM=True, WRITE_CACHE=write,
                                                                SATURATE=saturate, SCALED=scaled), num_warps=1)
        done.append(f"qk_norm_rope/{cache}/write={write}/scaled={scaled}")
    # one token a row (decode) and a verify step's 5 and 12 (T * G query rows padded to 16 and 32)
    for tokens, pad, splits, merge in ((1, 16, 1, False), (1, 16, 3, True), (1, 16, 3, False), (5, 16, 1, False),
                                       (5, 16, 3, True), (12, 32, 3, False)):
        types = dict(q_ptr="*bf16", k_ptr=f"*{cache}", v_ptr=f"*{cache}", lengths_ptr="*i64", out_ptr="*fp32",
                     lse_ptr="*fp32", final_ptr="*bf16", counter_ptr="*i32", scale="fp32", v_scale="fp32")
        compile_one(triton_attention._split_kernel, types,
                    dict(BLOCK_N=triton_attention.block_n(128), GROUP=2, GROUP_PAD=pad, HEAD_DIM=128,
                         PRECISION="tf32", SPLITS=splits, MERGE_HERE=merge, EARLY_V=True, TOKENS=tokens,
                         DOT_F16=cache != "bf16"),
                    num_stages=2 if cache == "bf16" and splits == 1 else 3)  # plan_launch's two depths
        done.append(f"split/{cache}/tokens={tokens}/splits={splits}/merge={merge}")
for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
    for split, gate, residual in ((1, False, False), (4, True, True), (2, False, True)):
        types = dict(a_ptr=f"*{dtype}", w_ptr=f"*{dtype}", bias_ptr=f"*{dtype}", res_ptr=f"*{dtype}",
                     out_ptr=f"*{dtype}", partial_ptr="*fp32", ticket_ptr="*i32")
        compile_one(small_gemm._small_gemm_kernel, types,
                    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, GATE=gate, HAS_BIAS=True,
                         HAS_RESIDUAL=residual, PRECISION=precision, UPCAST=False), num_stages=4)
        done.append(f"small_gemm/{dtype}/split={split}/gate={gate}")
for greedy in (False, True):  # the sampler's fast path over fp32 logits (the decode graph's output)
    types = dict(logits_ptr="*fp32", temperature="fp32", seed_ptr="*i64", max_ptr="*fp32", sum_ptr="*fp32",
                 score_ptr="*fp32", index_ptr="*i32")
    compile_one(sampling_kernel._partial_kernel, types, dict(GREEDY=greedy, BLOCK=sampling_kernel.BLOCK))
    done.append(f"sample_partial/greedy={greedy}")
types = dict(logits_ptr="*fp32", temperature="fp32", max_ptr="*fp32", sum_ptr="*fp32", score_ptr="*fp32",
             index_ptr="*i32", tokens_ptr="*i64", logprobs_ptr="*fp32")
compile_one(sampling_kernel._combine_kernel, types, dict(SPLITS=64), num_warps=1)
done.append("sample_combine")
for dtype in ("bf16", "fp32"):  # --quantization w8a8_fp8's per-token activation quantizer (the GPU's e4m3 cast)
    for block, one_pass, warps in ((fp8_channel.QUANTIZE_BLOCK, False, 4), (4096, True, 8),
                                   (fp8_channel.QUANTIZE_ONE_PASS, True, 16)):
        compile_one(fp8_channel._quantize_tokens_kernel, dict(x_ptr=f"*{dtype}", q_ptr="*fp8e4nv", s_ptr="*fp32",
                                                              fp8_max="fp32"),
                    dict(BLOCK=block, ONE_PASS=one_pass, EMULATE_E4M3_CAST=False), num_warps=warps)
        done.append(f"quantize_tokens/{dtype}/{block}")
print(json.dumps(done))
"""


def test_decode_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_BACKENDS_IN_TREE="1")
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(compiled) == 3 * (3 + 6) + 6 + 3 + 2 * 3, compiled

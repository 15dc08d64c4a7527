"""One decode step of the embedded engine under the torch profiler: its time, HBM fraction and kernels.

    python bench/decode_step.py --model qwen3-0.6b --batch 128 --position 511 --out     # H200
    python bench/decode_step.py --model qwen3-0.6b --batch 16 --position 383 --out
    python bench/decode_step.py --model qwen3-0.6b --batch 128 --position 511 --kv-cache-dtype fp8_e4m3 --out
    python bench/decode_step.py --model qwen3-4b --batch 128 --position 143 --quantization fp8 --out  # FP8 weights
    python bench/decode_step.py --model tiny --device cpu --steps 3                      # smoke run
    python bench/decode_step.py ... --without qk_norm_rope --without mlp_residual_gemm   # A/B of a fusion
    python bench/decode_step.py --model qwen3-0.6b --batch 32 --position 383 --verify-tokens 5 --out
    python bench/decode_step.py ... --verify-tokens 5 --verify-eager          # the same through the generic forward

Builds a checkpoint of ``--model`` (``bench/engine_decode.py``'s ``build_checkpoint``: random bf16
weights with the public architecture's shapes) or loads ``--model-path``, puts ``--batch`` rows in
the KV cache with every row at ``--position`` (its new token at that position, so each row reads
``position + 1`` cached tokens) and runs the model runner's decode step, as the engine does (on CUDA
a replayed CUDA graph of the batch). No HTTP or scheduler; no sampling unless ``--sample``
(``fused``: the sampler's one-read kernel, ``torch``: its torch ops, either in the timed and profiled
step; ``sample_torch_ms`` / ``sample_fused_ms`` time each path alone on one step's logits).

Metrics:

* ``step_ms``: mean time of ``--steps`` back-to-back steps (CUDA events around them).
* ``step_bytes = weight_bytes + kv_bytes_per_token × batch × (position + 1)`` and
  ``hbm_fraction = step_bytes / step_seconds / HBM peak`` (the GPU's spec, ``bench.common.hbm_peak``: H200
  4.8e12, H100 3.35e12; recorded in the config as ``hbm_peak_bytes_per_s`` / ``hbm_peak_of``), as
  ``bench/engine_decode.py``'s ``roofline_fraction`` counts them (activations not counted);
  ``kv_bytes_per_token`` in the cache's own dtype (``--kv-cache-dtype fp8_e4m3``: half of bf16's), so
  the fraction of an FP8 cache counts the bytes it really reads.
* From ``--profile-steps`` profiled steps: ``kernels_per_step``, ``kernels_per_layer``,
  ``kernel_us_per_step`` (the sum of the kernels' device time) and ``top_kernels``: the ``--top``
  kernels by device time per step, each ``{"name", "us", "count"}`` (per step, names as the profiler
  reports them, cut at 90 characters: ``_split_kernel``, ``_decode_write_kernel``, cuBLAS GEMMs ...);
  ``kernel_us_by_class``: the same per-step time summed as ``gemm`` (every GEMM kernel, FP8 or not, lm_head
  included), ``attention``, ``norm_rope``, ``silu``, ``quantize``, ``sampling`` and ``other``.
* ``fused``: what the runner fused (``fused_projections``: q/k/v and gate/up GEMMs per layer;
  ``fused_ops``: the Triton norms, rotary and SiLU gate), so runs before and after a change say
  what they ran.

``--verify-tokens T`` (> 1) times a speculative verify step instead: every row feeds ``T`` tokens, the
last at ``--position`` (so it reads the same KV as the decode step), through ``ModelRunner.verify`` (the
``T``-token decode step, a CUDA graph on CUDA), or with ``--verify-eager`` through the generic forward the
verify step replaced (all-position logits, SDPA). ``step_bytes`` counts the same weights and KV.

On CPU the same step runs eagerly and the table lists CPU operators by self time (a smoke test of
the tool; CPU timings on a shared machine mean little). ``--out`` writes
``bench/results/decode_step-<machine>-<YYYYMMDD>.json`` (or the given ``.json`` path).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import hbm_peak, hbm_peak_config, write_result  # noqa: E402
from bench.engine_decode import ARCHITECTURES, build_checkpoint  # noqa: E402


def timed_steps(step, device: torch.device, steps: int) -> float:
    """Mean seconds per call of ``step`` over ``steps`` calls in a row."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / steps


def kernel_table(step, device: torch.device, steps: int) -> list[dict]:
    """Per-step device time and count of every kernel (CPU: every operator's self time) of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    rows = []
    for event in prof.key_averages():
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key[:90], "us": us / steps, "count": event.count / steps})
    return sorted(rows, key=lambda row: -row["us"])


# kernel name (as the profiler gives it) -> the class kernel_classes sums it into; first match wins, else "other"
KERNEL_CLASSES = (("quantize", re.compile(r"quantize", re.I)),
                  ("gemm", re.compile(r"gemm|nvjet|cutlass|splitKreduce|xmma|cublas|aten::(mm|addmm|bmm|linear)$",
                                      re.I)),
                  ("attention", re.compile(r"_split_kernel|_merge_kernel|_decode_write|_verify|attention|flash|"
                                           r"scaled_dot_product", re.I)),
                  ("norm_rope", re.compile(r"rmsnorm|norm_rope|_rope_kernel", re.I)),
                  ("silu", re.compile(r"silu", re.I)),
                  ("sampling", re.compile(r"_partial_kernel|_combine_kernel|sampl|softmax|argmax", re.I)))


def kernel_classes(table: list[dict]) -> dict[str, float]:
    """Per-step device microseconds of :func:`kernel_table`'s rows summed by class (:data:`KERNEL_CLASSES`): the
    GEMMs (FP8 Triton, cuBLAS and CUTLASS kernels, the lm_head's included), attention (with the cache writes),
    norms + rotary, the SiLU gate, FP8 quantize launches, sampling, and the rest."""
    sums = {name: 0.0 for name, _ in KERNEL_CLASSES} | {"other": 0.0}
    for row in table:
        name = next((name for name, pattern in KERNEL_CLASSES if pattern.search(row["name"])), "other")
        sums[name] += row["us"]
    return {name: round(us, 1) for name, us in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=["tiny", "small", *ARCHITECTURES],
                        help="checkpoint to build in a temporary directory (ignored with --model-path)")
    parser.add_argument("--model-path", default=None, help="an existing HF directory instead of --model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="the engine's --dtype (auto: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the engine's --kv-cache-dtype: auto (= --dtype), bf16, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--quantization", default=None, choices=["fp8", "w8a8_fp8"],
                        help="serve with FP8 linear layers (the engine's --quantization: fp8 block-wise, w8a8_fp8 "
                             "per channel)")
    parser.add_argument("--fp8-gemm-backend", default="auto",
                        choices=["auto", "weight_only", "triton", "cublas", "cutlass", "dequant"],
                        help="the engine's FP8 GEMM (--fp8-gemm-backend; with w8a8_fp8: auto, cutlass, triton, "
                             "cublas or dequant)")
    parser.add_argument("--batch", type=int, default=128, help="rows in the decode step")
    parser.add_argument("--position", type=int, default=511, help="every row's position (it reads position + 1 tokens)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--profile-steps", type=int, default=10, help="profiled steps (the kernel table averages them)")
    parser.add_argument("--top", type=int, default=30, help="kernels listed in top_kernels")
    parser.add_argument("--without", action="append", default=[],
                        choices=["qk_norm_rope", "mlp_residual_gemm", "kv_write_fusion", "attention_early_v",
                                 "fp8_quant_in_producer", "down_hand_off"],
                        help="run without this fusion (repeatable), for an A/B of it in one run (down_hand_off: "
                             "w8a8_fp8's cublas backend hands the down projection's unscaled product to the next "
                             "layer's input RMSNorm; without, the Triton GEMM adds the residual in its epilogue)")
    parser.add_argument("--with", dest="with_", action="append", default=[],
                        choices=["small_m_gemm", "attention_merge_in_split"],
                        help="run with this measured-and-off kernel switched on (repeatable): small_m_gemm = the "
                             "decoder's linears through small_gemm.py up to 16 tokens; attention_merge_in_split = "
                             "the flash-decoding kernel merging its own splits")
    parser.add_argument("--attention-block-n", type=int, default=None,
                        help="positions per step of the flash-decoding kernel (default: triton_attention.block_n)")
    parser.add_argument("--verify-tokens", type=int, default=1,
                        help="time a verify step of this many tokens a row instead of a decode step (1: decode)")
    parser.add_argument("--verify-eager", action="store_true",
                        help="with --verify-tokens: through the generic forward (the verify path before the T-token step)")
    parser.add_argument("--sample", default="none", choices=["none", "fused", "torch"],
                        help="time each step with the engine's sampling of its logits (temperature 1): the one-read "
                             "kernel (sampling_kernel.py), or torch's ops (the path before it); sample_torch_ms and "
                             "sample_fused_ms time both alone")
    parser.add_argument("--out", nargs="?", const=str(ROOT / "bench" / "results"), default=None,
                        help="write the result JSON (default folder bench/results, or a .json path)")
    args = parser.parse_args()
    if args.verify_tokens < 1 or args.verify_tokens > args.position + 1:
        parser.error(f"--verify-tokens {args.verify_tokens} must be >= 1 and <= --position + 1")
    if args.verify_eager and args.verify_tokens == 1:
        parser.error("--verify-eager needs --verify-tokens > 1")
    if args.batch < 1 or args.position < 0 or args.steps < 1 or args.profile_steps < 1:
        parser.error(f"--batch {args.batch}, --steps {args.steps} and --profile-steps {args.profile_steps} must be "
                     f">= 1 and --position {args.position} >= 0")

    from slime.backends.embedded_engine.model_runner import ModelRunner

    path = args.model_path or build_checkpoint(args.model, tempfile.mkdtemp(prefix="decode_step_"))
    runner = ModelRunner(path, device=args.device, dtype=args.dtype, num_slots=args.batch,
                         slot_capacity=args.position + 1, kv_cache_dtype=args.kv_cache_dtype,
                         quantization=args.quantization, fp8_gemm_backend=args.fp8_gemm_backend)
    runner.grow_cache(args.position + 1)
    if "qk_norm_rope" in args.without:
        for module in runner.model.modules():
            if "fused_norm_rope" in vars(module):
                del module.fused_norm_rope
    if "attention_merge_in_split" in args.with_:
        from slime.backends.embedded_engine.kernels import triton_attention

        triton_attention.MERGE_IN_SPLIT_KERNEL = True
    if "attention_early_v" in args.without:
        from slime.backends.embedded_engine.kernels import triton_attention

        triton_attention.EARLY_V_LOAD = False
    if "small_m_gemm" in args.with_:
        from slime.backends.embedded_engine.kernels import small_gemm

        small_gemm.ENABLED = True
    if "kv_write_fusion" in args.without:
        from slime.backends.embedded_engine.kernels import fused_ops

        fused_ops.KV_WRITE_IN_NORM_ROPE = False
    if "fp8_quant_in_producer" in args.without:
        from slime.backends.embedded_engine.kernels import fused_ops

        fused_ops.FP8_QUANT_IN_PRODUCER = False
    if "down_hand_off" in args.without:
        from slime.backends.embedded_engine.kernels import fused_ops

        fused_ops.DOWN_SCALES_TO_NEXT_LAYER = False
    if "mlp_residual_gemm" in args.without:
        from slime.backends.embedded_engine.kernels import fused_ops

        fused_ops.MLP_RESIDUAL_IN_GEMM = False
    if args.attention_block_n is not None:
        from slime.backends.embedded_engine.kernels import triton_attention

        triton_attention.block_n = lambda dim: args.attention_block_n
    # the runner captured its decode graphs at start (and again in grow_cache), before any switch above: recapture
    # them with the switches in place (lazily, at the warm-up steps below), else an A/B times the same graphs twice
    runner.graphs.clear()
    if runner.kv_cache.shape.num_slots < args.batch:
        raise SystemExit(f"--batch {args.batch} x --position {args.position}: the device holds only "
                         f"{runner.kv_cache.shape.num_slots} slots of {runner.kv_cache.shape.slot_capacity} tokens")
    tokens, positions = [5] * args.batch, [args.position] * args.batch
    width = args.verify_tokens
    if width > 1:  # a verify step: T tokens a row ending at --position
        from slime.backends.embedded_engine.model_runner import ForwardRow

        starts = [args.position - width + 1] * args.batch
        rows = [ForwardRow([5] * width, start, want_all_logits=True) for start in starts]

        def step():
            if args.verify_eager:
                runner.forward(list(range(args.batch)), rows)
            else:
                runner.verify([[5] * width] * args.batch, starts)
    else:
        def step():
            logits = runner.decode(tokens, positions)
            if args.sample != "none":
                sample_on_device(logits, sample_rows, generator)

    from slime.backends.embedded_engine import sampler
    from slime.backends.embedded_engine.sampler import RowSampling, sample_on_device

    sampler.FUSED_ON_CUDA = args.sample == "fused"
    sample_rows, generator = [RowSampling(temperature=1.0)] * args.batch, torch.Generator(device=runner.device).manual_seed(0)

    for _ in range(3):  # capture the graph, warm the allocator
        step()
    device = runner.device
    seconds = timed_steps(step, device, args.steps)
    sample_ms = {}
    if args.sample != "none" and width == 1:  # the sampling alone on one step's logits, both paths
        logits = runner.decode(tokens, positions).clone()
        for path in ("torch", "fused"):
            sampler.FUSED_ON_CUDA = path == "fused"
            sample_ms[path] = 1e3 * timed_steps(lambda: sample_on_device(logits, sample_rows, generator), device,
                                                args.steps)
        sampler.FUSED_ON_CUDA = args.sample == "fused"
    table = kernel_table(step, device, args.profile_steps)

    layers = getattr(runner.config, "text_config", runner.config).num_hidden_layers
    weight_bytes = runner.weight_bytes()
    kv_bytes_per_token = runner.kv_cache.shape.bytes_per_token(runner.kv_cache.dtype)
    step_bytes = weight_bytes + kv_bytes_per_token * args.batch * (args.position + 1)
    kernels = sum(row["count"] for row in table)
    metrics = {"step_ms": seconds * 1e3, "step_bytes": step_bytes, "weight_bytes": weight_bytes,
               "kv_bytes_per_token": kv_bytes_per_token, "kernels_per_step": kernels,
               "kernels_per_layer": kernels / layers, "kernel_us_per_step": sum(row["us"] for row in table),
               "kernel_us_by_class": kernel_classes(table),
               "sample_ms": sample_ms.get(args.sample), "sample_torch_ms": sample_ms.get("torch"),
               "sample_fused_ms": sample_ms.get("fused"),
               "cuda_graph": runner.graphs.captures > 0, "verify_graph_captures": runner.graphs.verify_captures,
               "top_kernels": [{**row, "us": round(row["us"], 1)} for row in table[:args.top]]}
    if device.type == "cuda":
        metrics["hbm_fraction"] = step_bytes / seconds / hbm_peak()[0]
    config = {"model": args.model_path or args.model, "device": args.device, "dtype": str(runner.dtype),
              "kv_cache_dtype": str(runner.kv_cache.dtype), "quantization": args.quantization,
              "fp8_gemm_backend": args.fp8_gemm_backend if args.quantization else None, "batch": args.batch, "position": args.position, "steps": args.steps,
              "profile_steps": args.profile_steps, "attention_backend": runner.attention_backend,
              "verify_tokens": args.verify_tokens, "verify_eager": args.verify_eager, "sample": args.sample,
              "without": args.without, "with": args.with_, "attention_block_n": args.attention_block_n,
              # getattr: the tool also runs on checkouts from before the fusions (the "before" figures)
              "fused": {"fused_projections": getattr(runner, "fused_projections", {}),
                        "fused_ops": getattr(runner, "fused_ops", {})},
              **hbm_peak_config()}
    write_result("decode_step", config, metrics, args.out)


if __name__ == "__main__":
    main()

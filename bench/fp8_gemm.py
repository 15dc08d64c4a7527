"""The FP8 GEMM alone: bf16 ``torch.nn.functional.linear`` vs the fused Triton FP8 kernel
(``fp8_triton.w8a8_block_matmul``) on the decoder linear shapes of the Qwen3 architectures, per batch
size. Prints JSON.

    python bench/fp8_gemm.py --out                         # H200: qwen3-0.6b/1.7b/4b, M in 1,16,64,128,256,2048
    python bench/fp8_gemm.py --sweep --rows 1,16,64,128 --out bench/results/fp8_gemm-nvidia-h200-$(date +%Y%m%d)-sweep.json
    TRITON_INTERPRET=1 PYTHONPATH=.venv/triton-interpreter python bench/fp8_gemm.py --models tiny --rows 1,16 \\
        --repeats 1                                         # CPU: tiny shapes through Triton's interpreter

Shapes (per decoder layer, ``bench/engine_decode.py``'s ``ARCHITECTURES``): ``q`` [heads·head_dim, H],
``kv`` [kv_heads·head_dim, H] (k and v: two per layer), ``o`` [H, heads·head_dim], ``gate_up``
[I, H] (two per layer), ``down`` [H, I]. ``--models tiny`` is a CPU-sized stand-in (H 256, I 512).

Timing is what a decode step sees: each measurement replays a CUDA graph of ``copies`` calls, each on
its own copy of the weight, with enough copies (>= 256 MiB of weights, at most 64) that the weights
come from HBM, not from the 50 MiB L2; CUDA events around the replay, median of ``--repeats``, divided
by ``copies``. (On the CPU: wall time of the calls, no graph; only a check that the script runs.)

Metrics, per ``<model>/<shape>/M<rows>``: ``bf16_us``, ``fp8_us`` (the planned tiles,
``fp8_tiles``), ``speedup`` (bf16 / fp8), ``bf16_tb_s`` / ``fp8_tb_s`` (bytes moved at least: weight +
scales + activations in + output out, per second, in TB/s) and ``*_hbm_fraction`` (that / 4.8 TB/s,
the H200's HBM3e spec), ``fp8_max_rel_err`` (against ``fp8.reference_matmul(quantize_inputs=True)``:
a sanity check that the timed kernel computes the right thing), ``fp8_model_us`` (what
``fp8_triton.estimated_cycles``, the cost model ``plan_tiles`` picks by, predicted). Per
``<model>/layer/M<rows>``: the seven linears of a layer summed (``bf16_us``, ``fp8_us``, ``speedup``).
With ``--sweep``, also ``fp8_sweep_best_us`` / ``fp8_sweep_best_tiles`` / ``planned_over_best`` /
``fp8_sweep_best_model_us`` over every launch ``plan_tiles`` chooses from
(``fp8_triton.candidate_tiles``): whether the model ranks them as the GPU does.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_result  # noqa: E402
from bench.engine_decode import ARCHITECTURES  # noqa: E402
from slime.backends.embedded_engine import fp8  # noqa: E402

H200_HBM_BYTES_PER_S = 4.8e12
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_hidden_layers=2)
COLD_WEIGHT_BYTES = 256 * 2**20
CLOCK_HZ = 1.98e9  # the clock fp8_triton.estimated_cycles assumes
MAX_COPIES = 64


def layer_shapes(arch: dict) -> dict[str, tuple[int, int, int]]:
    """``name -> (out_features, in_features, linears of this shape per layer)``."""
    hidden, inter = arch["hidden_size"], arch["intermediate_size"]
    q, kv = arch["num_attention_heads"] * arch["head_dim"], arch["num_key_value_heads"] * arch["head_dim"]
    return {"q": (q, hidden, 1), "kv": (kv, hidden, 2), "o": (hidden, q, 1), "gate_up": (inter, hidden, 2),
            "down": (hidden, inter, 1)}


def time_us(calls, device: torch.device, repeats: int) -> float:
    """Median microseconds of one of ``calls`` (a list of closures, each on its own weight copy)."""
    for call in calls:  # warm-up: compiles, allocates the split-K counters
        call()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - start) / len(calls) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def bench_shape(out_features: int, in_features: int, rows_list: list[int], device: torch.device, args) -> dict:
    from slime.backends.embedded_engine import fp8_triton

    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(device, torch.bfloat16)
    values, scales = fp8.quantize_weight(weight)
    copies = max(1, min(MAX_COPIES, math.ceil(COLD_WEIGHT_BYTES / weight.numel() / weight.element_size())))
    if device.type != "cuda":
        copies = 1
    bf16_weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    fp8_weights = [(values, scales)] + [(values.clone(), scales.clone()) for _ in range(copies - 1)]
    results = {}
    for rows in rows_list:
        x = torch.randn(rows, in_features, generator=generator).to(device, torch.bfloat16)
        moved_in_out = rows * in_features * 2 + rows * out_features * 2
        bf16_bytes = weight.numel() * 2 + moved_in_out
        fp8_bytes = values.numel() + scales.numel() * 4 + moved_in_out
        bf16_us = time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16_weights], device, args.repeats)
        planned = fp8_triton.plan_tiles(rows, out_features, in_features, device)
        sms = fp8_triton._sm_count(device)

        def fp8_calls(tiles):
            return [lambda v=v, s=s: fp8_triton.w8a8_block_matmul(x, v, s, torch.bfloat16, tiles=tiles)
                    for v, s in fp8_weights]

        fp8_us = time_us(fp8_calls(planned), device, args.repeats)
        reference = fp8.reference_matmul(x, values, scales, quantize_inputs=True)
        out = fp8_triton.w8a8_block_matmul(x, values, scales, torch.float32)
        result = {
            "bf16_us": bf16_us, "fp8_us": fp8_us, "speedup": bf16_us / fp8_us, "fp8_tiles": str(planned),
            "fp8_model_us": fp8_triton.estimated_cycles(planned, rows, out_features, in_features, sms) / CLOCK_HZ * 1e6,
            "bf16_tb_s": bf16_bytes / bf16_us / 1e6, "fp8_tb_s": fp8_bytes / fp8_us / 1e6,
            "fp8_max_rel_err": float((out - reference).abs().max() / reference.abs().max()),
        }
        result["bf16_hbm_fraction"] = result["bf16_tb_s"] * 1e12 / H200_HBM_BYTES_PER_S
        result["fp8_hbm_fraction"] = result["fp8_tb_s"] * 1e12 / H200_HBM_BYTES_PER_S
        if args.sweep:
            timed = []
            for tiles in fp8_triton.candidate_tiles(rows, in_features):
                try:
                    timed.append((time_us(fp8_calls(tiles), device, args.repeats), tiles))
                except Exception as error:  # a tile the compiler cannot fit (shared memory, registers)
                    print(f"skipped {tiles}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
            best_us, best = min(timed, key=lambda item: item[0])
            result.update({"fp8_sweep_best_us": best_us, "fp8_sweep_best_tiles": str(best),
                           "planned_over_best": fp8_us / best_us,
                           "fp8_sweep_best_model_us": fp8_triton.estimated_cycles(
                               best, rows, out_features, in_features, sms) / CLOCK_HZ * 1e6})
        results[rows] = result
        print(f"[{out_features}x{in_features} M={rows}] bf16 {bf16_us:.1f} us, fp8 {fp8_us:.1f} us "
              f"({result['speedup']:.2f}x, {planned})", file=sys.stderr)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b",
                        help=f"comma-separated, from {['tiny', *[m for m in ARCHITECTURES if m.startswith('qwen3')]]}")
    parser.add_argument("--rows", default=None, help="batch sizes M (default 1,16,64,128,256,2048 on CUDA, 1,16 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time every candidate tile (slow: compiles each)")
    parser.add_argument("--out", nargs="?", const="bench/results", default=None,
                        help="write the results file (a directory, or a .json path)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    from slime.backends.embedded_engine import fp8_triton

    if not fp8_triton.available(device):
        parser.error(f"the FP8 Triton kernel cannot run on {device.type}: it needs CUDA with triton, or "
                     "TRITON_INTERPRET=1 and an importable triton on the CPU")
    rows_list = [int(r) for r in (args.rows or ("1,16,64,128,256,2048" if device.type == "cuda" else "1,16")).split(",")]
    metrics = {}
    for model in args.models.split(","):
        if model != "tiny" and model not in ARCHITECTURES:
            parser.error(f"--models: unknown {model!r}; choose from tiny, {', '.join(ARCHITECTURES)}")
        arch = TINY if model == "tiny" else ARCHITECTURES[model]
        layer = {rows: {"bf16_us": 0.0, "fp8_us": 0.0} for rows in rows_list}
        for name, (out_features, in_features, count) in layer_shapes(arch).items():
            for rows, result in bench_shape(out_features, in_features, rows_list, device, args).items():
                for key, value in result.items():
                    metrics[f"{model}/{name}/M{rows}/{key}"] = value
                layer[rows]["bf16_us"] += count * result["bf16_us"]
                layer[rows]["fp8_us"] += count * result["fp8_us"]
        for rows, total in layer.items():
            metrics[f"{model}/layer/M{rows}/bf16_us"] = total["bf16_us"]
            metrics[f"{model}/layer/M{rows}/fp8_us"] = total["fp8_us"]
            metrics[f"{model}/layer/M{rows}/speedup"] = total["bf16_us"] / total["fp8_us"]
    config = {"models": args.models, "rows": rows_list, "device": args.device, "repeats": args.repeats,
              "sweep": args.sweep, "cold_weight_bytes": COLD_WEIGHT_BYTES if device.type == "cuda" else None,
              "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None}
    return write_result("fp8_gemm", config, metrics, args.out)


if __name__ == "__main__":
    main()

"""The FP8 GEMM alone, one column per path: bf16 ``torch.nn.functional.linear`` (cuBLAS), the
weight-only Triton kernel (W8A16: bf16 activations, the e4m3 weight dequantized in registers), the
fused Triton W8A8 kernel (activations quantized inside the GEMM), the two-kernel Triton W8A8 path (a
quantize kernel, then the GEMM on e4m3 A) and cuBLASLt's block-scaled FP8 GEMM (``torch._scaled_mm``
after the same quantize kernel; where it runs: sm_90, torch with CUDA >= 12.9), on the decoder linear
shapes of the Qwen3 architectures, per batch size. Prints JSON; one run shows which path wins where,
the data ``fp8.GEMM_DISPATCH`` (the ``auto`` table) is updated from.

    python bench/fp8_gemm.py --out                         # H200: qwen3-0.6b/1.7b/4b, M in 1,16,64,128,256,2048
    python bench/fp8_gemm.py --sweep weight_only --rows 16,64,128 --out bench/results/fp8_gemm-nvidia-h200-$(date +%Y%m%d)-sweep.json
    TRITON_INTERPRET=1 PYTHONPATH=.venv/triton-interpreter python bench/fp8_gemm.py --models tiny --rows 1,16 \\
        --repeats 1                                         # CPU: tiny shapes through Triton's interpreter

Shapes (per decoder layer, ``bench/engine_decode.py``'s ``ARCHITECTURES``), ``--layout fused`` (the
default, what the engine runs): ``qkv`` [(heads + 2·kv_heads)·head_dim, H], ``o`` [H, heads·head_dim],
``gate_up`` [2·I, H], ``down`` [H, I]; ``--layout separate``: ``q``, ``kv``
(two per layer), ``o``, ``gate_up`` [I, H] (two per layer), ``down``. ``--models tiny`` is a CPU-sized
stand-in (H 256, I 512).

Timing is what a decode step sees: each measurement replays a CUDA graph of ``copies`` calls, each on
its own copy of the weight, with enough copies (>= 256 MiB of weights, at most 64) that the weights
come from HBM, not from the 50 MiB L2; CUDA events around the replay, median of ``--repeats``, divided
by ``copies``. The quantize kernel of the two-kernel and cuBLASLt paths is inside the timed call.
(On the CPU: wall time of the calls, no graph; only a check that the script runs.)

Metrics, per ``<model>/<shape>/M<rows>``: ``bf16_us``; per FP8 path ``<path>_us`` (path in
``weight_only``, ``fused``, ``two_kernel``, ``cublas``; ``cublas`` absent where it does not run),
``<path>_speedup`` (bf16 / it) and ``<path>_max_rel_err`` (its bf16 output against
``fp8_numerics.reference_matmul``, with quantized activations for the W8A8 paths, over the largest output: a
sanity check that the timed path computes the right thing; the bf16 rounding gives up to ~4e-3, a
wrong scale or a lost partial ~1e-1); ``best_path`` (the fastest FP8 path), ``auto_path`` (what
``--fp8-gemm-backend auto`` runs there today) and ``auto_over_best`` (its time over the best's:
> 1.05 means ``fp8.GEMM_DISPATCH`` should change there); ``weight_only_tiles`` / ``fused_tiles`` /
``two_kernel_tiles`` (the planned Triton tiles) and ``<path>_model_us`` (what the cost model the plan
picks by predicted: ``fp8_triton.weight_only_cycles`` / ``estimated_cycles``; not for the two-kernel
GEMM where it loads by TMA, whose tiles come from ``fp8_triton.plan_tma_tiles``' rule);
``two_kernel_tma`` (whether the two-kernel GEMM loaded by TMA) and, where it did,
``two_kernel_pointer_us`` (the same GEMM with pointer loads and the cost model's tiles, an earlier
form of the kernel, kept for comparison); ``bf16_tb_s`` /
``fp8_tb_s`` (bytes moved at least, weight + scales + activations in + output out, per second of
bf16 / of the best FP8 path, in TB/s) and ``*_hbm_fraction`` (that over the GPU's HBM spec,
``bench.common.hbm_peak``: the H200's 4.8 TB/s, the H100's 3.35). Per ``<model>/<shape>``: ``quantize_weight_torch_us`` / ``quantize_weight_triton_us`` (the FP8 weight
update's quantization of that matrix, from bf16: the torch version plus its copy into the storage, and
the one-launch kernel into the storage) and ``quantize_weight_triton_tb_s`` (3 bytes a weight over its
time); per ``<model>/layer``, both summed over a layer. Per ``<model>/layer/M<rows>``: the linears of a layer summed, ``bf16_us`` and per path
``<path>_us`` / ``<path>_speedup``, and ``auto_us`` / ``auto_speedup``. With ``--sweep P`` (P in
``fused``, ``two_kernel``, ``weight_only``), also ``P_sweep_best_us`` / ``P_sweep_best_tiles`` /
``P_planned_over_best`` / ``P_sweep_best_model_us`` and ``P_sweep_us`` (every launch's time, keyed
``"<block_m>x<block_n> split<k> w<warps> s<stages>"``: the table a tile rule is fitted to) over every launch the plan chooses from
(``fp8_triton.candidate_tiles`` / ``tma_candidates`` / ``weight_only_candidates``): whether the plan
picks as the GPU ranks them.

``--rowwise`` (CUDA, sm_90) adds the GEMMs of ``--quantization w8a8_fp8``, which is what SGLang runs for an
online FP8 of a bf16 checkpoint on Hopper (one e4m3 scale per output channel of the weight, one per token of the
activations), whose scales apply once after the K loop instead of at every 128-wide K group: ``rowwise_gemm_us``
its ``cutlass`` path (``fp8_channel.scaled_mm``: ``torch._scaled_mm`` with row-wise scales) and
``channel_triton_us`` its ``triton`` path (``fp8_channel.triton_matmul``, planned tiles in
``channel_triton_tiles``) and ``unscaled_gemm_us`` the GEMM of its ``cublas`` path (``fp8_channel.unscaled_mm``:
cuBLASLt with unit scales, the two scales left to the kernel that reads the product), each alone on activations
quantized beforehand (as the RMSNorms and the SiLU gate hand them over); ``rowwise_speedup`` /
``channel_triton_speedup`` / ``unscaled_gemm_speedup`` are bf16 over them (per layer also ``channel_cublas_us``: what
the ``cublas`` backend runs, the unscaled GEMM for q/k/v, o and down and the Triton one for gate/up), ``*_hbm_fraction`` their bytes
(e4m3 weight, fp32 scales, activations in and out) per second over the HBM spec. ``rowwise_quant_err`` /
``block_quant_err`` are each scheme's mean |error| against the fp32 product of the unquantized bf16 operands,
over the mean |output| (what the coarser scales cost in accuracy; random weights have no outlier channels, real
ones do). ``--sweep channel`` (with ``--rowwise``) times the per-channel Triton GEMM over
``fp8_channel.candidate_tiles`` (the block-wise GEMM's TMA launches and 128-row tiles on 8 warps):
``channel_sweep_us``, ``channel_sweep_best_us`` / ``_tiles``, ``channel_planned_over_best``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import hbm_peak, hbm_peak_config, time_us, write_result  # noqa: E402
from bench.engine_decode import ARCHITECTURES  # noqa: E402
from slime.backends.embedded_engine.fp8 import block as fp8  # noqa: E402
from slime.backends.embedded_engine.fp8 import numerics as fp8_numerics  # noqa: E402
from slime.backends.embedded_engine.fp8 import quantize as fp8_quantize  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_hidden_layers=2)
COLD_WEIGHT_BYTES = 256 * 2**20
CLOCK_HZ = 1.98e9  # the clock fp8_triton.estimated_cycles assumes
MAX_COPIES = 64


def layer_shapes(arch: dict, layout: str = "separate") -> dict[str, tuple[int, int, int]]:
    """``name -> (out_features, in_features, linears of this shape per layer)``; ``layout`` ``fused``:
    q/k/v and gate/up as one GEMM each, as the engine runs them (``fused_projections.py``; under FP8
    where each part is whole 128-row blocks, which every Qwen3 size is)."""
    hidden, inter = arch["hidden_size"], arch["intermediate_size"]
    q, kv = arch["num_attention_heads"] * arch["head_dim"], arch["num_key_value_heads"] * arch["head_dim"]
    if layout == "fused":
        return {"qkv": (q + 2 * kv, hidden, 1), "o": (hidden, q, 1), "gate_up": (2 * inter, hidden, 1),
                "down": (hidden, inter, 1)}
    return {"q": (q, hidden, 1), "kv": (kv, hidden, 2), "o": (hidden, q, 1), "gate_up": (inter, hidden, 2),
            "down": (hidden, inter, 1)}


def _paths(device: torch.device, out_features: int, in_features: int) -> list[str]:
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas

    paths = ["weight_only", "fused", "two_kernel"]
    if fp8_cublas.available(device) and fp8_cublas.shape_supported(out_features, in_features):
        paths.append("cublas")
    return paths


def _fp8_call(path: str, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, tiles=None):
    from slime.backends.embedded_engine.fp8 import cublas as fp8_cublas
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if path == "cublas":
        return fp8_cublas.block_matmul(x, values, scales, torch.bfloat16)
    if path == "weight_only":
        return fp8_triton.weight_only_matmul(x, values, scales, tiles=tiles)
    return fp8_triton.w8a8_block_matmul(x, values, scales, torch.bfloat16, tiles=tiles,
                                        quantize_first=path == "two_kernel")


def bench_weight_quantize(out_features: int, in_features: int, device: torch.device, repeats: int) -> dict:
    """One weight's quantization (an FP8 weight update's cost per matrix): the torch version
    (``fp8_numerics._quantize_weight_torch``, three fp32 copies, then the copy into the storage) against the
    one-launch kernel writing into the storage (``fp8_triton.quantize_weight_into``); bf16 weight."""
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    weight = torch.randn(out_features, in_features, device=device).to(torch.bfloat16)
    values, scales = fp8_numerics._quantize_weight_torch(weight)

    def torch_update():
        new_values, new_scales = fp8_numerics._quantize_weight_torch(weight)
        values.copy_(new_values)
        scales.copy_(new_scales)

    result = {}
    for name, call in (("torch", torch_update), ("triton", lambda: fp8_triton.quantize_weight_into(weight, values, scales))):
        call()
        times = []
        for _ in range(max(1, repeats // 4) if device.type == "cuda" else 1):
            if device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(begin.elapsed_time(end) * 1e3)
            else:
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e6)
        result[f"quantize_weight_{name}_us"] = statistics.median(times)
    result["quantize_weight_triton_tb_s"] = weight.numel() * 3 / result["quantize_weight_triton_us"] / 1e6
    return result


def _tiles_label(tiles) -> str:
    """``Tiles(64, 128, 2, 4, 4)`` -> ``"64x128 split2 w4 s4"`` (a key of the sweep's table)."""
    fields = dataclasses.astuple(tiles)
    return f"{fields[0]}x{fields[1]} split{fields[2]} w{fields[3]} s{fields[4]}"


def time_each(candidates: list, timer) -> list[tuple[float, object]]:
    """(``timer(tiles)`` in us, tiles) for each candidate launch the compiler can build (the others are skipped
    with a line on stderr: shared memory, registers)."""
    timed = []
    for tiles in candidates:
        try:
            timed.append((timer(tiles), tiles))
        except Exception as error:
            print(f"skipped {tiles}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
    return timed


def rowwise_probe(x: torch.Tensor, weight: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                  device: torch.device, repeats: int, copies: int, sweep: bool) -> dict:
    """The ``--rowwise`` columns (see the module doc)."""
    from slime.backends.embedded_engine.fp8 import channel as fp8_channel

    quantized = fp8_channel.quantize_rows(x)
    w8, w_scales = fp8_channel.quantize_rows(weight)
    weights = [(w8, w_scales)] + [(w8.clone(), w_scales.clone()) for _ in range(copies - 1)]

    # the engine's calls with the activations quantized beforehand (by their producer)
    def cutlass(w8, w_scales):
        return fp8_channel.scaled_mm(x, w8, w_scales, torch.bfloat16, quantized=quantized)

    def triton_gemm(w8, w_scales, tiles=None):
        return fp8_channel.triton_matmul(x, w8, w_scales, torch.bfloat16, quantized=quantized, tiles=tiles)

    def timed(gemm, tiles=None):
        return time_us([lambda w=w, s=s: gemm(w, s, tiles) if tiles else gemm(w, s) for w, s in weights], device,
                       repeats)

    rows, (out_features, in_features) = x.shape[0], w8.shape
    exact = x.float() @ weight.float().t()
    scale = exact.abs().mean()
    reference = fp8_channel.reference_matmul(x, w8, w_scales)
    block = fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=True).float()
    def unscaled(w8, w_scales):  # the cublas backend's GEMM: its reader applies the scales
        return fp8_channel.unscaled_mm(quantized[0], w8, torch.bfloat16)

    result = {"rowwise_gemm_us": timed(cutlass), "channel_triton_us": timed(triton_gemm),
              "unscaled_gemm_us": timed(unscaled),
              "channel_triton_tiles": str(fp8_channel.plan_tiles(rows, out_features, in_features, device)),
              "rowwise_quant_err": float((cutlass(w8, w_scales).float() - exact).abs().mean() / scale),
              "block_quant_err": float((block - exact).abs().mean() / scale),
              "channel_triton_max_rel_err": float((triton_gemm(w8, w_scales).float() - reference).abs().max()
                                                  / reference.abs().max())}
    moved = w8.numel() + w_scales.numel() * 4 + rows * in_features * 2 + rows * out_features * 2
    for column in ("rowwise_gemm", "channel_triton", "unscaled_gemm"):
        result[f"{column}_hbm_fraction"] = moved / (result[f"{column}_us"] * 1e-6) / hbm_peak()[0]
    if sweep:
        table = time_each(fp8_channel.candidate_tiles(rows, in_features), lambda tiles: timed(triton_gemm, tiles))
        best_us, best_tiles = min(table, key=lambda item: item[0])
        result.update({"channel_sweep_us": {_tiles_label(tiles): round(us, 2) for us, tiles in table},
                       "channel_sweep_best_us": best_us, "channel_sweep_best_tiles": str(best_tiles),
                       "channel_planned_over_best": result["channel_triton_us"] / best_us})
    return result


def bench_shape(out_features: int, in_features: int, rows_list: list[int], device: torch.device, args) -> dict:
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(device, torch.bfloat16)
    values, scales = fp8_quantize.quantize_weight(weight)
    copies = max(1, min(MAX_COPIES, math.ceil(COLD_WEIGHT_BYTES / weight.numel() / weight.element_size())))
    if device.type != "cuda":
        copies = 1
    bf16_weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    fp8_weights = [(values, scales)] + [(values.clone(), scales.clone()) for _ in range(copies - 1)]
    sms = fp8_triton._sm_count(device)
    paths = _paths(device, out_features, in_features)
    results = {}
    for rows in rows_list:
        x = torch.randn(rows, in_features, generator=generator).to(device, torch.bfloat16)
        moved_in_out = rows * in_features * 2 + rows * out_features * 2
        bf16_bytes = weight.numel() * 2 + moved_in_out
        fp8_bytes = values.numel() + scales.numel() * 4 + moved_in_out
        result = {"bf16_us": time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16_weights], device,
                                     args.repeats)}
        references = {quantized: fp8_numerics.reference_matmul(x, values, scales, quantize_inputs=quantized)
                      for quantized in (False, True)}

        def fp8_calls(path, tiles=None):
            return [lambda v=v, s=s: _fp8_call(path, x, v, s, tiles) for v, s in fp8_weights]

        for path in paths:
            result[f"{path}_us"] = time_us(fp8_calls(path), device, args.repeats)
            result[f"{path}_speedup"] = result["bf16_us"] / result[f"{path}_us"]
            out = _fp8_call(path, x, values, scales).float()
            reference = references[path != "weight_only"]  # W8A8 paths: against the quantized activations
            result[f"{path}_max_rel_err"] = float((out - reference).abs().max() / reference.abs().max())
        if args.rowwise:
            result.update(rowwise_probe(x, weight, values, scales, device, args.repeats, copies,
                                        sweep="channel" in args.sweep))
            result["rowwise_speedup"] = result["bf16_us"] / result["rowwise_gemm_us"]
            result["channel_triton_speedup"] = result["bf16_us"] / result["channel_triton_us"]
            result["unscaled_gemm_speedup"] = result["bf16_us"] / result["unscaled_gemm_us"]
        tma = fp8_triton.tma_usable(fp8_triton.quantize_activation(x)[0], values)
        result["two_kernel_tma"] = tma
        if tma:  # the same GEMM with pointer loads and the cost model's tiles (the earlier kernel)
            fp8_triton.USE_TMA = False
            try:
                result["two_kernel_pointer_us"] = time_us(fp8_calls("two_kernel"), device, args.repeats)
            finally:
                fp8_triton.USE_TMA = True
            result["two_kernel_tiles"] = str(fp8_triton.plan_tma_tiles(rows, out_features, in_features, device))
        for path in ("fused", "two_kernel") if not tma else ("fused",):
            planned = fp8_triton.plan_tiles(rows, out_features, in_features, device, a_quantized=path == "two_kernel")
            result[f"{path}_tiles"] = str(planned)
            result[f"{path}_model_us"] = fp8_triton.estimated_cycles(
                planned, rows, out_features, in_features, sms, a_quantized=path == "two_kernel") / CLOCK_HZ * 1e6
        planned = fp8_triton.plan_weight_only(rows, out_features, in_features, device)
        result["weight_only_tiles"] = str(planned)
        result["weight_only_model_us"] = fp8_triton.weight_only_cycles(
            planned, rows, out_features, in_features, sms) / CLOCK_HZ * 1e6
        best = min(paths, key=lambda path: result[f"{path}_us"])
        auto = fp8.gemm_path("auto", rows, out_features, in_features, device)
        result.update({"best_path": best, "auto_path": auto,
                       "auto_over_best": result[f"{auto}_us"] / result[f"{best}_us"],
                       "bf16_tb_s": bf16_bytes / result["bf16_us"] / 1e6,
                       "fp8_tb_s": fp8_bytes / result[f"{best}_us"] / 1e6})
        result["bf16_hbm_fraction"] = result["bf16_tb_s"] * 1e12 / hbm_peak()[0]
        result["fp8_hbm_fraction"] = result["fp8_tb_s"] * 1e12 / hbm_peak()[0]
        for swept in (path for path in args.sweep if path != "channel"):  # channel: in rowwise_probe
            candidates = (fp8_triton.weight_only_candidates(rows, in_features) if swept == "weight_only"
                          else fp8_triton.tma_candidates(rows, in_features) if swept == "two_kernel" and tma
                          else fp8_triton.candidate_tiles(rows, in_features))
            timed = time_each(candidates, lambda tiles: time_us(fp8_calls(swept, tiles), device, args.repeats))
            best_us, best_tiles = min(timed, key=lambda item: item[0])
            result[f"{swept}_sweep_us"] = {_tiles_label(tiles): round(us, 2) for us, tiles in timed}
            result.update({f"{swept}_sweep_best_us": best_us, f"{swept}_sweep_best_tiles": str(best_tiles),
                           f"{swept}_planned_over_best": result[f"{swept}_us"] / best_us})
            if swept != "two_kernel" or not tma:
                model = (fp8_triton.weight_only_cycles(best_tiles, rows, out_features, in_features, sms)
                         if swept == "weight_only" else fp8_triton.estimated_cycles(
                             best_tiles, rows, out_features, in_features, sms, a_quantized=swept == "two_kernel"))
                result[f"{swept}_sweep_best_model_us"] = model / CLOCK_HZ * 1e6
        results[rows] = result
        columns = ", ".join(f"{path} {result[f'{path}_us']:.1f} us ({result[f'{path}_speedup']:.2f}x)" for path in paths)
        print(f"[{out_features}x{in_features} M={rows}] bf16 {result['bf16_us']:.1f} us, {columns}; best {best}, "
              f"auto {auto}", file=sys.stderr)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b",
                        help=f"comma-separated, from {['tiny', *[m for m in ARCHITECTURES if m.startswith('qwen3')]]}")
    parser.add_argument("--rows", default=None, help="batch sizes M (default 1,16,64,128,256,2048 on CUDA, 1,16 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", nargs="?", const="fused", default="",
                        help="also time every candidate tile of these Triton paths (comma-separated: fused, "
                             "two_kernel (its TMA launches, fp8_triton.tma_candidates, where TMA runs), "
                             "weight_only, channel (the per-channel Triton GEMM of w8a8_fp8, with --rowwise); "
                             "bare --sweep = fused; slow: compiles each)")
    parser.add_argument("--layout", choices=("fused", "separate"), default="fused",
                        help="fused (default): q/k/v and gate/up as one GEMM each, as the engine runs them; "
                             "separate: each Hugging Face linear alone")
    parser.add_argument("--rowwise", action="store_true",
                        help="also time the per-channel x per-token FP8 GEMMs of --quantization w8a8_fp8 "
                             "(torch._scaled_mm row-wise, and the per-channel Triton GEMM; CUDA sm_90)")
    parser.add_argument("--out", nargs="?", const="bench/results", default=None,
                        help="write the results file (a directory, or a .json path)")
    args = parser.parse_args(argv)
    args.sweep = [path for path in args.sweep.split(",") if path]
    if any(path not in ("fused", "two_kernel", "weight_only", "channel") for path in args.sweep):
        parser.error(f"--sweep {','.join(args.sweep)}: choose from fused, two_kernel, weight_only, channel")
    if "channel" in args.sweep and not args.rowwise:
        parser.error("--sweep channel times the per-channel GEMM of --rowwise: add --rowwise")
    device = torch.device(args.device)
    if args.rowwise and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9):
        parser.error("--rowwise: torch._scaled_mm's row-wise FP8 GEMM runs on sm_90 (H100/H200) only")
    from slime.backends.embedded_engine.fp8 import triton_kernels as fp8_triton

    if not fp8_triton.available(device):
        parser.error(f"the FP8 Triton kernel cannot run on {device.type}: it needs CUDA with triton, or "
                     "TRITON_INTERPRET=1 and an importable triton on the CPU")
    rows_list = [int(r) for r in (args.rows or ("1,16,64,128,256,2048" if device.type == "cuda" else "1,16")).split(",")]
    metrics = {}
    for model in args.models.split(","):
        if model != "tiny" and model not in ARCHITECTURES:
            parser.error(f"--models: unknown {model!r}; choose from tiny, {', '.join(ARCHITECTURES)}")
        arch = TINY if model == "tiny" else ARCHITECTURES[model]
        layer = {rows: {} for rows in rows_list}  # rows -> column -> [time of one layer's linears of each shape]
        shapes = layer_shapes(arch, args.layout)
        quantize = {}
        for name, (out_features, in_features, count) in shapes.items():
            for key, value in bench_weight_quantize(out_features, in_features, device, args.repeats).items():
                metrics[f"{model}/{name}/{key}"] = value
                quantize[key] = quantize.get(key, 0.0) + count * value
            for rows, result in bench_shape(out_features, in_features, rows_list, device, args).items():
                for key, value in result.items():
                    metrics[f"{model}/{name}/M{rows}/{key}"] = value
                result["auto_us"] = result[f"{result['auto_path']}_us"]
                if "unscaled_gemm_us" in result:  # w8a8's cublas backend: cuBLASLt for q/k/v, o and down, Triton for
                    # gate/up (down's scales and residual add go to the next layer's input RMSNorm; the model's last
                    # layer adds its own on Triton, not counted here)
                    result["channel_cublas_us"] = result["unscaled_gemm_us" if name in ("qkv", "q", "kv", "o", "down")
                                                         else "channel_triton_us"]
                for column in ("bf16", "weight_only", "fused", "two_kernel", "two_kernel_pointer", "cublas", "auto",
                               "rowwise_gemm", "channel_triton", "unscaled_gemm", "channel_cublas"):
                    if f"{column}_us" in result:
                        layer[rows].setdefault(column, []).append(count * result[f"{column}_us"])
        for key in ("quantize_weight_torch_us", "quantize_weight_triton_us"):  # one layer's update
            metrics[f"{model}/layer/{key}"] = quantize[key]
        for rows, columns in layer.items():
            bf16_us = sum(columns["bf16"])
            metrics[f"{model}/layer/M{rows}/bf16_us"] = bf16_us
            for column, times in columns.items():
                if column != "bf16" and len(times) == len(shapes):  # timed on every shape of the layer
                    metrics[f"{model}/layer/M{rows}/{column}_us"] = sum(times)
                    metrics[f"{model}/layer/M{rows}/{column}_speedup"] = bf16_us / sum(times)
    config = {"models": args.models, "rows": rows_list, "device": args.device, "repeats": args.repeats,
              "sweep": ",".join(args.sweep), "layout": args.layout, "rowwise": args.rowwise, "cold_weight_bytes": COLD_WEIGHT_BYTES if device.type == "cuda" else None,
              "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None,
              **hbm_peak_config()}
    return write_result("fp8_gemm", config, metrics, args.out)


if __name__ == "__main__":
    main()

"""The flash-decoding kernel alone (``triton_attention.decode_attention``, split + merge launches), one
decoder layer's call on the Qwen3 attention shapes, per batch, position and KV-cache dtype: its time,
the HBM bandwidth it reaches over the KV bytes it must read, and with ``--sweep`` every launch the
kernel takes (``triton_attention.Launch``: positions per step, splits, warps, stages) timed against
the planned one — the table the launch plan is fitted to.

    python bench/decode_attention.py --out                    # H200: 0.6B/1.7B/4B, B=128, positions 143/511/2047
    python bench/decode_attention.py --models qwen3-4b --positions 143 --kv-dtypes bf16,fp8_e4m3 --sweep \\
        --out bench/results/decode_attention-nvidia-h200-$(date +%Y%m%d)-sweep.json
    TRITON_INTERPRET=1 PYTHONPATH=.venv/triton-interpreter python bench/decode_attention.py --models tiny \\
        --batch 2 --positions 5 --sweep --repeats 1             # CPU: a check that it runs, no timing worth reading

The call is what the engine's decode graphs make: every row at ``position`` (it reads position + 1
keys), ``kv_length`` the slot capacity the graph is captured over (the engine's first
512 positions, or the request grown to whole 256-position steps; each row stops at its own length), the cache ``[rows, kv_heads, capacity, head_dim]`` in the cache dtype (FP8: e4m3 / e5m2
values with scale 1). Timing: ``bench.common.time_us`` (as ``bench/fp8_gemm.py``), a CUDA graph of
``copies`` calls, each on its own cache (>= 256 MiB of KV in all, so the reads come from HBM, not the
50 MiB L2), CUDA events around the replay, median of ``--repeats``, divided by ``copies``.

Metrics per ``<model>/B<batch>/P<position>/<kv dtype>``: ``us`` (the planned launch), ``kv_bytes`` (the
keys and values the rows must read: rows x (position + 1) x kv_heads x head_dim x 2 x bytes),
``tb_s`` and ``hbm_fraction`` (kv_bytes over the time, over the GPU's HBM spec: ``bench.common.hbm_peak``), ``launch`` (the planned one,
``"b<block_n> split<splits> w<warps> s<stages>"``), ``step_ms`` (``us`` times the model's layers: the
attention share of a decode step). With ``--sweep``: ``sweep_us`` (every launch's time, same keys),
``sweep_best_us`` / ``sweep_best_launch`` / ``planned_over_best``, and ``sweep_max_abs_diff`` (the
largest difference of any launch's output from the planned one's: a launch that computes something
else shows here, not as a fast time).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import hbm_peak, hbm_peak_config, time_us, write_result  # noqa: E402
from bench.engine_decode import ARCHITECTURES  # noqa: E402

TINY = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MIN_TIMED_BYTES = 256 << 20  # per graph replay: well past the 50 MiB L2


def launch_name(launch) -> str:
    return f"b{launch.block_n} split{launch.splits} w{launch.num_warps} s{launch.num_stages}"


def candidates(kv_length: int, dim: int) -> list:
    """Every launch the sweep times: 32/64/128 positions a step (64 at most for heads over 128 wide),
    1-16 splits while each keeps a whole block, 4 or 8 warps, 1-3 stages."""
    from slime.backends.embedded_engine.kernels import triton_attention

    launches = []
    for block in (32, 64, 128):
        if dim > 128 and block > 64:
            continue
        blocks = -(-kv_length // block)
        for splits in (1, 2, 4, 8, 16):
            if splits > blocks:
                break
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    launches.append(triton_attention.Launch(block, splits, warps, stages))
    return launches


def measure(arch: dict, batch: int, position: int, kv_dtype: str, device: torch.device, repeats: int,
            sweep: bool) -> dict:
    from slime.backends.embedded_engine.kernels import triton_attention
    from slime.backends.embedded_engine.model_runner import ModelRunner

    heads, kv_heads, dim = arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"]
    need = position + 1
    step = ModelRunner.SLOT_GRANULARITY  # the slot capacity the engine's graphs read (ModelRunner.grow_cache)
    kv_length = max(ModelRunner.INITIAL_SLOT_CAPACITY, -(-need // step) * step)
    query_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache_dtype = KV_DTYPES[kv_dtype] if kv_dtype != "bf16" or device.type == "cuda" else torch.float32  # CPU: fp32
    element = torch.empty((), dtype=cache_dtype).element_size()
    per_cache = 2 * batch * kv_heads * kv_length * dim * element
    copies = max(1, min(64, -(-MIN_TIMED_BYTES // per_cache))) if device.type == "cuda" else 1
    gen = torch.Generator(device=device).manual_seed(position)

    def cache():
        return torch.randn(batch, kv_heads, kv_length, dim, generator=gen, device=device).to(cache_dtype)

    keys = [cache() for _ in range(copies)]
    values = [cache() for _ in range(copies)]
    query = torch.randn(batch, heads, dim, generator=gen, device=device).to(query_dtype)
    lengths = torch.full((batch,), need, dtype=torch.long, device=device)
    scale = dim ** -0.5

    def run(launch, i=0):
        return triton_attention.decode_attention(query, keys[i], values[i], lengths, kv_length, scale, launch=launch)

    def calls(launch):  # one per cache copy
        return [lambda i=i: run(launch, i) for i in range(copies)]

    planned = triton_attention.plan_launch(batch, kv_heads, kv_length, dim, element)
    us = time_us(calls(planned), device, repeats)
    kv_bytes = 2 * batch * need * kv_heads * dim * element
    result = {"us": us, "kv_bytes": kv_bytes, "tb_s": kv_bytes / us / 1e6,
              "hbm_fraction": kv_bytes / (us * 1e-6) / hbm_peak()[0], "launch": launch_name(planned),
              "kv_length": kv_length, "copies": copies, "step_ms": us * arch["num_hidden_layers"] / 1e3}
    if sweep:
        reference = run(planned).float()
        times, worst = {}, 0.0
        for launch in candidates(kv_length, dim):
            worst = max(worst, float((run(launch).float() - reference).abs().max()))
            times[launch_name(launch)] = round(time_us(calls(launch), device, repeats), 2)
        best = min(times, key=times.get)
        result.update(sweep_us=times, sweep_best_us=times[best], sweep_best_launch=best,
                      planned_over_best=us / times[best], sweep_max_abs_diff=worst)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    qwen3 = ", ".join(name for name in ARCHITECTURES if name.startswith("qwen3"))
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b",
                        help=f"comma-separated: tiny (CPU) or {qwen3}")
    parser.add_argument("--batch", default="128", help="comma-separated rows per call")
    parser.add_argument("--positions", default="143,511,2047", help="comma-separated: every row's position")
    parser.add_argument("--kv-dtypes", default="bf16", help=f"comma-separated: {', '.join(KV_DTYPES)}")
    parser.add_argument("--sweep", action="store_true", help="time every launch (triton_attention.Launch) too")
    parser.add_argument("--fp8-dots", choices=("fp16", "bf16"), default="fp16",
                        help="the dots' dtype over an FP8 cache under a bf16 query (triton_attention.FP8_DOTS_IN_FP16; "
                             "bf16 for the A/B)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", nargs="?", const=str(ROOT / "bench" / "results"), default=None,
                        help="write the result JSON (default folder bench/results, or a .json path)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        parser.error("the kernel needs CUDA, or TRITON_INTERPRET=1 on the CPU")
    models = args.models.split(",")
    for model in models:
        if model != "tiny" and model not in ARCHITECTURES:
            parser.error(f"--models: unknown {model!r}")
    for kv_dtype in args.kv_dtypes.split(","):
        if kv_dtype not in KV_DTYPES:
            parser.error(f"--kv-dtypes: unknown {kv_dtype!r} (one of {', '.join(KV_DTYPES)})")
    from slime.backends.embedded_engine.kernels import triton_attention

    triton_attention.FP8_DOTS_IN_FP16 = args.fp8_dots == "fp16"
    config = {"models": models, "batch": args.batch, "positions": args.positions, "kv_dtypes": args.kv_dtypes,
              "fp8_dots": args.fp8_dots, "sweep": args.sweep, "repeats": args.repeats, "device": str(device),
              **hbm_peak_config()}
    metrics = {}
    for model in models:
        arch = TINY if model == "tiny" else ARCHITECTURES[model]
        for batch in map(int, args.batch.split(",")):
            for position in map(int, args.positions.split(",")):
                for kv_dtype in args.kv_dtypes.split(","):
                    result = measure(arch, batch, position, kv_dtype, device, args.repeats, args.sweep)
                    key = f"{model}/B{batch}/P{position}/{kv_dtype}"
                    best = f"; best {result['sweep_best_us']:.1f} ({result['sweep_best_launch']})" if args.sweep else ""
                    print(f"{key}: {result['us']:.1f} us ({result['launch']}), {result['tb_s']:.2f} TB/s{best}",
                          file=sys.stderr)
                    metrics.update({f"{key}/{name}": value for name, value in result.items()})
                    if args.out:  # what is done survives a timeout
                        write_result("decode_attention", {**config, "partial": True}, metrics, args.out, echo=False)
    write_result("decode_attention", config, metrics, args.out)


if __name__ == "__main__":
    main()

"""Weight sync throughput: trainer → engine over the tensor (colocated) and distributed transports.

Prints JSON (and writes bench/results/weight_sync-<machine>-<date>.json with --out bench/results):
per transport and model, the bytes sent, seconds, GB/s and the fraction of the limit measured in the
same run — memcpy bandwidth of this machine on CPU, device copy / NCCL broadcast on GPU.

    python bench/weight_sync.py --models tiny qwen3-0.6b --out bench/results
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_result  # noqa: E402

def build_model_dir(name: str, root: str) -> str:
    """The tiny model, or a Qwen3 architecture with random bf16 weights (bench.engine_decode)."""
    from bench.engine_decode import build_checkpoint

    return build_checkpoint(name, os.path.join(root, name))


def memcpy_gbytes_per_s(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def measure(model_dir: str, transport: str, colocate: bool, dtype: torch.dtype, bucket_bytes: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from slime.backends.embedded_engine.launch import EmbeddedEngineProcess
    from slime.backends.update_weight import bucket_named_tensors, make_weight_updater

    state = {k: v.to(dtype) for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
             if k != "lm_head.weight"}
    engine = EmbeddedEngineProcess(model_dir, extra_args=["--dtype", str(dtype).replace("torch.", ""),
                                                          "--max-running-requests", "2", "--context-length", "256"])
    engine.start()
    try:
        engine.wait_healthy(600)
        args = SimpleNamespace(update_weight_transport=transport, update_weight_mode="full", distributed_timeout_minutes=10,
                               cpu_only=not torch.cuda.is_available(), hf_checkpoint=model_dir)
        updater = make_weight_updater(args, [engine.url], [1], colocate=colocate)
        times = []
        for version in range(repeats + 1):
            start = time.perf_counter()
            sent = updater.update(bucket_named_tensors(state.items(), bucket_bytes), str(version + 1))
            times.append(time.perf_counter() - start)
        updater.close()
    finally:
        engine.stop()
    seconds = min(times[1:])  # the first call pays for connecting the group
    return {"bytes": sent, "seconds": seconds, "gbytes_per_s": sent / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.6b"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    limit = memcpy_gbytes_per_s()
    metrics = {"memcpy_gbytes_per_s": limit}
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            model_dir = build_model_dir(name, root)
            for label, transport, colocate in (("tensor", "nccl", True), ("distributed", "nccl", False)):
                r = measure(model_dir, transport, colocate, dtype, args.bucket_mb << 20, args.repeats)
                key = f"{name}/{label}"
                metrics[f"{key}/gbytes_per_s"] = r["gbytes_per_s"]
                metrics[f"{key}/seconds"] = r["seconds"]
                metrics[f"{key}/bytes"] = r["bytes"]
                metrics[f"{key}/fraction_of_limit"] = r["gbytes_per_s"] / limit
    write_result("weight_sync", {"models": args.models, "dtype": args.dtype, "bucket_mb": args.bucket_mb,
                                 "limit": "memcpy (CPU, measured in this run)"}, metrics, args.out)


if __name__ == "__main__":
    main()

"""Weight sync throughput: trainer → engine over the tensor (colocated) and distributed transports.

Prints JSON (and writes bench/results/weight_sync-<machine>-<models>[-pipelined].json with --out bench/results):
per transport and model, the bytes sent, seconds, GB/s and the fraction of the limit measured in the
same run — memcpy bandwidth of this machine on CPU, device copy / NCCL broadcast on GPU.

    python bench/weight_sync.py --models tiny qwen3-0.6b --out bench/results          # CPU
    python bench/weight_sync.py --tensor-models qwen3-0.6b --distributed-models qwen3-1.7b --out bench/results  # GPU

On GPU the trainer's bf16 tensors live on GPU 0. ``tensor`` (colocated): the engine runs on the same
GPU and receives CUDA-IPC handles; the limit is the one-way device-to-device copy bandwidth
(read+write bytes / 2). ``distributed``: the engine runs on GPU 1 and receives an NCCL broadcast;
the limit is a plain NCCL broadcast between the two GPUs measured in this run (needs 2 GPUs).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

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


def device_copy_gbytes_per_s(nbytes: int = 1 << 30) -> float:
    """One-way device copy bandwidth of GPU 0 (bytes copied / s; each byte is read and written)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _broadcast_worker(rank: int, port: int, nbytes: int, out) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.broadcast(buf, 0)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    if rank == 0:
        out.put(nbytes / best / 1e9)
    dist.destroy_process_group()


def nccl_broadcast_gbytes_per_s(nbytes: int = 1 << 30) -> float:
    """NCCL broadcast GPU 0 -> GPU 1 of a 1 GiB buffer, best of 5, in two fresh processes."""
    import torch.multiprocessing as mp

    from slime.backends.embedded_engine.serving.launch import find_free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_broadcast_worker, args=(rank, port, nbytes, out)) for rank in range(2)]
    for p in procs:
        p.start()
    value = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return value


def measure(model_dir: str, transport: str, colocate: bool, dtype: torch.dtype, bucket_sizes: list[int],
            repeats: int) -> dict[int, dict]:
    """One engine, every bucket size in turn: ``{bucket_bytes: {bytes, seconds, gbytes_per_s}}``."""
    from transformers import AutoModelForCausalLM

    from slime.backends.embedded_engine.serving.launch import EmbeddedEngineProcess
    from slime.backends.update_weight import bucket_named_tensors, make_weight_updater
    from slime.utils.arguments_groups import flag_defaults

    gpu = torch.cuda.is_available()
    device = "cuda:0" if gpu else "cpu"
    state = {k: v.to(device=device, dtype=dtype) for k, v in
             AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items() if k != "lm_head.weight"}
    extra = ["--dtype", str(dtype).replace("torch.", ""), "--max-running-requests", "2", "--context-length", "256"]
    env = None
    if gpu:
        # colocated: the engine shares GPU 0 with the trainer; disaggregated: it runs alone on GPU 1
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(torch.cuda.device_count())))
        env = {"CUDA_VISIBLE_DEVICES": visible.split(",")[0 if colocate else 1]}
        extra += ["--device", "cuda", "--mem-fraction-static", "0.3"]
    engine = EmbeddedEngineProcess(model_dir, extra_args=extra, env=env)
    engine.start()
    try:
        engine.wait_healthy(600)
        args = flag_defaults(update_weight_transport=transport, update_weight_mode="full", distributed_timeout_minutes=10,
                             cpu_only=not gpu, hf_checkpoint=model_dir)
        updater = make_weight_updater(args, [engine.url], [1], colocate=colocate)
        results, version = {}, 0
        for bucket_bytes in bucket_sizes:
            times = []
            for _ in range(repeats + 1):
                version += 1
                start = time.perf_counter()
                sent = updater.update(bucket_named_tensors(state.items(), bucket_bytes), str(version))
                if gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            seconds = min(times[1:])  # the first call pays for connecting the group / warming buffers
            results[bucket_bytes] = {"bytes": sent, "seconds": seconds, "gbytes_per_s": sent / seconds / 1e9}
        updater.close()
    finally:
        engine.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.6b"],
                        help="models measured with both transports (default on CPU)")
    parser.add_argument("--tensor-models", nargs="+", default=None, help="models measured with the tensor transport only")
    parser.add_argument("--distributed-models", nargs="+", default=None,
                        help="models measured with the distributed transport only")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[512],
                        help="bucket size(s) in MiB (--update-weight-buffer-size); the first is the headline figure, "
                             "each further one adds <model>/<transport>/bucket_<MiB>/... metrics")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.is_available()
    runs = [(name, label) for name in args.models for label in ("tensor", "distributed")]
    if args.tensor_models is not None or args.distributed_models is not None:
        runs = [(n, "tensor") for n in args.tensor_models or []] + [(n, "distributed") for n in args.distributed_models or []]
    if gpu:
        limits = {"tensor": device_copy_gbytes_per_s()}
        if any(label == "distributed" for _, label in runs):
            if torch.cuda.device_count() < 2:
                raise SystemExit("the distributed transport on GPU needs 2 GPUs (NCCL refuses two ranks on one device)")
            limits["distributed"] = nccl_broadcast_gbytes_per_s()
        metrics = {"device_copy_gbytes_per_s": limits["tensor"]}
        if "distributed" in limits:
            metrics["nccl_broadcast_gbytes_per_s"] = limits["distributed"]
        limit_text = "tensor: one-way device copy of GPU 0; distributed: NCCL broadcast GPU0->GPU1 (both measured in this run)"
    else:
        memcpy = memcpy_gbytes_per_s()
        limits = {"tensor": memcpy, "distributed": memcpy}
        metrics = {"memcpy_gbytes_per_s": memcpy}
        limit_text = "memcpy (CPU, measured in this run)"
    with tempfile.TemporaryDirectory() as root:
        dirs = {}
        for name, label in runs:
            model_dir = dirs.get(name) or dirs.setdefault(name, build_model_dir(name, root))
            sizes = [mb << 20 for mb in args.bucket_mb]
            results = measure(model_dir, "nccl", label == "tensor", dtype, sizes, args.repeats)
            for i, size in enumerate(sizes):
                r = results[size]
                key = f"{name}/{label}" + ("" if i == 0 else f"/bucket_{size >> 20}")
                metrics[f"{key}/gbytes_per_s"] = r["gbytes_per_s"]
                metrics[f"{key}/seconds"] = r["seconds"]
                metrics[f"{key}/bytes"] = r["bytes"]
                metrics[f"{key}/fraction_of_limit"] = r["gbytes_per_s"] / limits[label]
    write_result("weight_sync", {"runs": [f"{n}/{l}" for n, l in runs], "dtype": args.dtype,
                                 "bucket_mb": args.bucket_mb[0] if len(args.bucket_mb) == 1 else args.bucket_mb,
                                 "device": "cuda" if gpu else "cpu", "limit": limit_text}, metrics, args.out)


if __name__ == "__main__":
    main()

"""Benchmark one Megatron-Core training step (GRPO policy loss) and print JSON; the same workload
and MFU definition as bench/train_step.py (FSDP2), so the two results sit side by side.

    torchrun --nproc-per-node 1 bench/megatron_train_step.py --model qwen3-0.6b --max-tokens-per-gpu 16384 \
        --num-samples 224 --group-size 8 --out bench/results
    torchrun --nproc-per-node 2 bench/megatron_train_step.py --model qwen3-1.7b ...   # data parallel
    torchrun --nproc-per-node 2 bench/megatron_train_step.py ... --megatron-flags '--pipeline-model-parallel-size 2'

GPU only (the Megatron backend needs CUDA). The workload flags, the training set-up and the metrics
are bench/train_step.py's own functions: ``tokens_per_s`` (trained tokens / optimizer-step wall time,
all ranks), ``mfu`` (training FLOP/s per device — 6·N per token + LM head + causal attention — over
the bf16 matmul peak measured in this run), ``mfu_vs_spec`` (over the 989 TFLOP/s H200 dense spec),
``nonpad_fraction``, ``budget_fill``, ``micro_batches_per_rank``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_result  # noqa: E402
from bench.train_step import (  # noqa: E402
    add_workload_arguments,
    build_checkpoint,
    run_workload,
    workload_flags,
    workload_metrics,
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser, model="qwen3-0.6b", max_tokens_per_gpu=16384, num_samples=224, group_size=8)
    parser.add_argument("--megatron-flags", default="", help="extra slime flags, e.g. '--tensor-model-parallel-size 2'")
    parser.add_argument("--out", default=None, help="directory (or .json path) for the results file")
    bench = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/megatron_train_step.py needs CUDA (the Megatron backend is GPU-only)")

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a single process without torchrun: any free port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    from slime.backends.megatron_utils.model import have_transformer_engine
    from slime.backends.training.worker import TrainWorker
    from slime.arguments import parse_args

    with tempfile.TemporaryDirectory() as tmp:
        shared = [os.path.join(tmp, "model")]  # one machine: every rank reads rank 0's directory
        dist.broadcast_object_list(shared, src=0)
        model_dir = shared[0]
        if rank == 0:
            build_checkpoint(bench.model, model_dir)
        dist.barrier()
        args = parse_args([*workload_flags(bench, "megatron", model_dir), "--actor-num-gpus-per-node", str(world),
                           *bench.megatron_flags.split()])
        worker = TrainWorker(args)
        worker.init()
        device = torch.device("cuda", local_rank)
        results, shard, peak = run_workload(worker, args, bench, worker.backend.hf_config()["vocab_size"], rank, world, device)
        dist.barrier()  # rank 0's directory outlives every rank's use of it

    metrics = workload_metrics(results, shard, bench, peak, device)
    if rank == 0:
        write_result("megatron_train_step", {
            "model": bench.model, "world_size": world, "max_tokens_per_gpu": bench.max_tokens_per_gpu,
            "num_samples": bench.num_samples, "sample_len": [bench.min_len, bench.max_len], "iters": bench.iters,
            "megatron_flags": bench.megatron_flags, "precision": "fp32 params, bf16 autocast",
            "layer_spec": "transformer_engine" if have_transformer_engine() else "local",
        }, metrics, bench.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

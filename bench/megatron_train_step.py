"""Benchmark one Megatron-Core training step (GRPO policy loss) and print JSON; the same workload
and MFU definition as bench/train_step.py (FSDP2), so the two results sit side by side.

    torchrun --nproc-per-node 1 bench/megatron_train_step.py --model qwen3-0.6b --max-tokens-per-gpu 16384 \
        --num-samples 224 --group-size 8 --out bench/results
    torchrun --nproc-per-node 2 bench/megatron_train_step.py --model qwen3-1.7b ...   # data parallel

GPU only (the Megatron backend needs CUDA). Metrics: ``tokens_per_s`` (trained tokens / optimizer-step
wall time, all ranks), ``mfu`` (training FLOP/s per device — 6·N per token + LM head + causal
attention, the FSDP benchmark's count — over the bf16 matmul peak measured in this run),
``mfu_vs_spec`` (over the 989 TFLOP/s H200 dense spec), ``micro_batches_per_rank``.
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
from bench.train_step import ARCHITECTURES, H200_BF16_DENSE_PEAK, build_checkpoint, make_samples, measured_peak_flops  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=["tiny", "small", *ARCHITECTURES])
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--num-samples", type=int, default=224, help="samples per rollout step (all ranks)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=96)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
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

    from slime.backends.megatron_utils.worker import MegatronTrainWorker
    from slime.utils.arguments import parse_args
    from slime.utils.train_data import convert_samples_to_train_data, split_train_data_by_dp

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        if rank == 0:
            build_checkpoint(bench.model, model_dir)
        dist.barrier()
        args = parse_args(["--train-backend", "megatron", "--rollout-backend", "embedded", "--debug-train-only",
                           "--num-rollout", "100", "--hf-checkpoint", model_dir,
                           "--rollout-batch-size", str(bench.num_samples // bench.group_size),
                           "--n-samples-per-prompt", str(bench.group_size), "--num-steps-per-rollout", "1",
                           "--lr", "1e-6", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(bench.max_tokens_per_gpu),
                           "--balance-data", "--actor-num-gpus-per-node", str(world)])
        worker = MegatronTrainWorker(args)
        worker.init()
        data = convert_samples_to_train_data(args, make_samples(bench, worker.hf_config["vocab_size"], seed=0))
        shard = split_train_data_by_dp(args, data, world)[rank]
        peak = measured_peak_flops(torch.device("cuda", local_rank))
        results = []
        for i in range(bench.warmup + bench.iters):
            metrics = worker.train(i, shard)
            if i >= bench.warmup:
                results.append(metrics)

    tflops = sum(m["perf/actor_train_tflops"] for m in results) / len(results)
    metrics = {
        "tokens_per_s": sum(m["perf/actor_train_tok_per_s"] for m in results) / len(results),
        "mfu": tflops * 1e12 / peak,
        "mfu_vs_spec": tflops * 1e12 / H200_BF16_DENSE_PEAK,
        "achieved_tflops_per_device": tflops,
        "measured_peak_tflops": peak / 1e12,
        "micro_batches_per_rank": len(shard["micro_batch_indices"]),
    }
    if rank == 0:
        from slime.backends.megatron_utils.model import have_transformer_engine

        write_result("megatron_train_step", {
            "model": bench.model, "world_size": world, "max_tokens_per_gpu": bench.max_tokens_per_gpu,
            "num_samples": bench.num_samples, "sample_len": [bench.min_len, bench.max_len], "iters": bench.iters,
            "precision": "fp32 params, bf16 autocast", "layer_spec": "transformer_engine" if have_transformer_engine() else "local",
        }, metrics, bench.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

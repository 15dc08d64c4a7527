"""Benchmark one FSDP2 training step (GRPO policy loss, packed micro-batches) and print JSON.

    python bench/train_step.py                                  # tiny model on CPU
    python bench/train_step.py --model qwen3-0.6b --max-tokens-per-gpu 16384   # GPU, random bf16 weights
    torchrun --nproc-per-node 2 bench/train_step.py --model qwen3-1.7b ...      # several GPUs
    python bench/train_step.py --out                            # also write bench/results/train_step-<machine>-<model>-<variant>.json

Metrics: ``tokens_per_s`` (trained tokens / optimizer-step wall time, all ranks), ``mfu`` (achieved
training FLOP/s per device — 6·N per token + causal attention — over the matmul peak *measured in
this run*: fp32 on CPU, bf16 on GPU; ``mfu_vs_spec`` on GPU uses the 989 TFLOP/s H200 dense spec),
``nonpad_fraction`` (real tokens / tokens processed, minimum over micro-batches: the packing adds no
padding, so this is 1 unless a dummy micro-batch was needed) and ``budget_fill`` (tokens per
micro-batch / ``--max-tokens-per-gpu``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import git_commit, machine_name, result_name  # noqa: E402

# Architectures of public Qwen3 checkpoints (shapes only; weights are random).
ARCHITECTURES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}
H200_BF16_DENSE_PEAK = 989e12


def build_checkpoint(model: str, out_dir: str) -> str:
    """Write an HF checkpoint (config, random weights, tokenizer) for ``model`` into ``out_dir``."""
    from slime.utils.tiny_model import build_tiny_model, build_tokenizer

    if model in ("tiny", "small"):
        return str(build_tiny_model(out_dir, size=model, seed=0))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**ARCHITECTURES[model], max_position_embeddings=32768, rope_theta=1000000.0, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(1024).save_pretrained(out_dir)
    return out_dir


def measured_peak_flops(device: torch.device) -> float:
    """Matmul FLOP/s measured now: bf16 8192³ on GPU, fp32 1024³ on CPU (best of a few runs)."""
    n, dtype, repeats = (8192, torch.bfloat16, 10) if device.type == "cuda" else (1024, torch.float32, 5)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def make_samples(args, vocab_size: int, seed: int):
    from slime.utils.types import Sample

    rng = random.Random(seed)
    samples = []
    for i in range(args.num_samples):
        length = rng.randint(args.min_len, args.max_len)
        response = max(1, int(length * rng.uniform(0.5, 0.9)))
        tokens = [rng.randrange(10, vocab_size) for _ in range(length)]
        samples.append(Sample(index=i, group_index=i // args.group_size, tokens=tokens, response_length=response,
                              reward=float(rng.random() > 0.5), status=Sample.Status.COMPLETED))
    return samples


def add_workload_arguments(parser: argparse.ArgumentParser, *, model: str = "tiny", max_tokens_per_gpu: int = 512,
                           num_samples: int = 16, group_size: int = 4) -> None:
    """The workload flags shared by this benchmark and bench/megatron_train_step.py."""
    parser.add_argument("--model", default=model, choices=["tiny", "small", *ARCHITECTURES])
    parser.add_argument("--max-tokens-per-gpu", type=int, default=max_tokens_per_gpu)
    parser.add_argument("--num-samples", type=int, default=num_samples, help="samples per rollout step (all ranks)")
    parser.add_argument("--group-size", type=int, default=group_size)
    parser.add_argument("--min-len", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=96)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)


def workload_flags(bench, backend: str, model_dir: str) -> list[str]:
    """Train-only flags of the workload: one GRPO optimizer step per rollout step over
    ``--num-samples`` packed by ``--max-tokens-per-gpu``."""
    return ["--train-backend", backend, "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "100",
            "--hf-checkpoint", model_dir, "--rollout-batch-size", str(bench.num_samples // bench.group_size),
            "--n-samples-per-prompt", str(bench.group_size), "--num-steps-per-rollout", "1", "--lr", "1e-6",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(bench.max_tokens_per_gpu), "--balance-data"]


def run_workload(worker, args, bench, vocab_size: int, rank: int, world: int, device: torch.device):
    """Train ``--warmup`` + ``--iters`` rollout steps on the same shard; returns (metrics of the
    timed steps, this rank's shard, the matmul peak measured now)."""
    from slime.backends.training.train_data import convert_samples_to_train_data, split_train_data_by_dp

    data = convert_samples_to_train_data(args, make_samples(bench, vocab_size, seed=0))
    shard = split_train_data_by_dp(args, data, worker.layout.dp_size)[worker.layout.dp_rank]
    peak = measured_peak_flops(device)
    results = []
    steps = bench.warmup + bench.iters
    for i in range(steps):
        if getattr(bench, "profile", None) and i == steps - 1 and rank == 0:
            metrics = _profiled(lambda: worker.train(i, shard), bench.profile, device)
        else:
            metrics = worker.train(i, shard)
        if i >= bench.warmup:
            results.append(metrics)
    return results, shard, peak


def _profiled(step, out_dir: str, device: torch.device):
    """Run ``step`` under torch.profiler: a Chrome trace in ``out_dir``, the 25 ops of most self time printed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        result = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, "train_step_trace.json"))
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25), file=sys.stderr)
    return result


def workload_metrics(results: list[dict], shard, bench, peak: float, device: torch.device) -> dict:
    """tokens/s, MFU against the measured peak (and the H200 spec on GPU), packing figures."""
    micro_batch_tokens = [sum(int(shard.tokens[j].numel()) for j in mb) for mb in shard.schedule.micro_batch_indices]
    tok_per_s = sum(m["perf/actor_train_tok_per_s"] for m in results) / len(results)
    tflops = sum(m["perf/actor_train_tflops"] for m in results) / len(results)
    nonempty = [t for t in micro_batch_tokens if t > 0]
    metrics = {
        "tokens_per_s": tok_per_s,
        "mfu": tflops * 1e12 / peak,
        "nonpad_fraction": 1.0 if len(nonempty) == len(micro_batch_tokens) else min(nonempty or [0]) / max(nonempty or [1]),
        "budget_fill": sum(micro_batch_tokens) / (len(micro_batch_tokens) * bench.max_tokens_per_gpu),
        "achieved_tflops_per_device": tflops,
        "measured_peak_tflops": peak / 1e12,
        "micro_batches_per_rank": len(micro_batch_tokens),
    }
    if device.type == "cuda":
        metrics["mfu_vs_spec"] = tflops * 1e12 / H200_BF16_DENSE_PEAK
        metrics["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30  # this rank's
    return metrics


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="--fsdp-compile (torch.compile each decoder layer)")
    parser.add_argument("--log-probs-chunk-size", type=int, default=-1, help="rows per chunk of the log-prob head (-1: 2048)")
    parser.add_argument("--model-path", default=None,
                        help="an existing HF checkpoint instead of --model (any architecture the FSDP trainer takes, "
                             "e.g. bench/engine_decode.py's deepseek-v3-1b)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="torch.profiler over the last timed step: a Chrome trace in DIR and the top ops printed")
    parser.add_argument("--out", action="store_true", help="write bench/results/train_step-<machine>-<model>-<variant>.json")
    parser.add_argument("--machine", default=None, help="machine name for the results file (default: cpu-<n>core / cuda name)")
    bench = parser.parse_args(argv)

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    else:
        from tests.backends.fsdp_utils.fsdp_test_utils import free_port

        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()

    from slime.backends.training.worker import TrainWorker
    from slime.arguments import parse_args

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench.model_path or os.path.join(tmp, "model")
        if rank == 0 and not bench.model_path:
            build_checkpoint(bench.model, model_dir)
        dist.barrier()
        flags = workload_flags(bench, "fsdp", model_dir)
        if bench.gradient_checkpointing:
            flags.append("--gradient-checkpointing")
        if bench.compile:
            flags.append("--fsdp-compile")
        flags += ["--log-probs-chunk-size", str(bench.log_probs_chunk_size)]
        args = parse_args(flags)
        worker = TrainWorker(args)
        worker.init()
        results, shard, peak = run_workload(worker, args, bench, worker.backend.model.config.vocab_size, rank, world, device)

    metrics = workload_metrics(results, shard, bench, peak, device)
    if rank == 0:
        machine = bench.machine or machine_name()
        report = {
            "benchmark": "train_step",
            "date": datetime.date.today().isoformat(),
            "machine": machine,
            "command": "python " + " ".join([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])]),
            "git_commit": git_commit(),
            "config": {"model": bench.model_path or bench.model, "world_size": world, "max_tokens_per_gpu": bench.max_tokens_per_gpu,
                       "num_samples": bench.num_samples, "sample_len": [bench.min_len, bench.max_len],
                       "iters": bench.iters, "dtype": "bf16" if worker.backend.mixed_precision else "fp32",
                       "attn_implementation": worker.backend.attn_implementation,
                       "gradient_checkpointing": bench.gradient_checkpointing, "log_probs_chunk_rows": worker.backend.chunk_rows,
                       "fsdp_compile": bench.compile, "warmup_steps": bench.warmup, "profile": bool(bench.profile)},
            "metrics": metrics,
        }
        print(json.dumps(report, indent=2))
        if bench.out:
            out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, result_name("train_step", machine, report["config"]) + ".json")
            with open(path, "w") as f:
                json.dump(report, f, indent=2)
            print(f"wrote {path}", file=sys.stderr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

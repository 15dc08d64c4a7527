"""GPU check of MegatronTrainWorker run under torchrun by test_megatron_gpu.py (no Ray, no engine).

    torchrun --nproc-per-node N tests/backends/megatron_utils/megatron_worker_check.py \
        --hf-dir DIR --save DIR --out result.json [--resume] [--offload] [extra slime flags...]

Without --resume: init from the HF weights, train rollout 0 (records every step's ppo_kl), save it,
optionally offload + onload, train rollout 1. With --resume: init from --load (= --save), which must
resume at rollout 1, and train rollout 1 on the same data. Each run records rollout 1's metrics and
a checksum of every exported HF tensor, so the test can require resume to be exact.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--save", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--offload", action="store_true")
    cli, extra = parser.parse_known_args()
    sys.path.insert(0, os.getcwd())
    from slime.backends.megatron_utils.worker import MegatronTrainWorker
    from tests.backends.fsdp_utils.fsdp_test_utils import make_samples, rank_data
    from slime.utils.arguments import parse_args

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    argv = ["--train-backend", "megatron", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "4",
            "--hf-checkpoint", cli.hf_dir, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--seed", "0", "--lr", "1e-4", "--save", cli.save,
            "--actor-num-gpus-per-node", str(world), *extra]
    if cli.resume:
        argv += ["--load", cli.save]
    args = parse_args(argv)
    worker = MegatronTrainWorker(args)
    start = worker.init()
    result = {"start": start, "world": world}
    data = [rank_data(args, make_samples(8, seed=s, vocab=400), dp_size=world, rank=rank) for s in (1, 2)]
    if not cli.resume:
        worker.train(0, data[0])
        result["rollout0_ppo_kl"] = [m["train/ppo_kl"] for m in worker.get_step_metrics()]
        worker.save(0)
        if cli.offload:
            before = torch.cuda.memory_allocated()
            worker.offload()
            result["offload_freed_bytes"] = before - torch.cuda.memory_allocated()
            worker.onload()
    metrics = worker.train(1, data[1])
    result["rollout1"] = {k: v for k, v in metrics.items() if k.startswith("train/")}
    result["rollout1_ppo_kl"] = [m["train/ppo_kl"] for m in worker.get_step_metrics()]
    sums = {}
    for bucket in worker.iter_weight_buckets(64 << 20, torch.float32):
        for name, tensor in bucket:
            sums[name] = float(tensor.double().sum()) + float((tensor.double() ** 2).sum())
    result["weights"] = sums
    if rank == 0:
        with open(cli.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

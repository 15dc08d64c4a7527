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
    parser.add_argument("--role", default="actor", choices=["actor", "critic"])
    parser.add_argument("--save-hf", default=None, help="with --no-optimizer: also write the model as an HF directory")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="one rollout step's passes without the optimizer (Megatron's optimizer needs CUDA): "
                             "log-probs, loss metrics and the reduced gradients, for comparing layouts on the CPU")
    cli, extra = parser.parse_known_args()
    sys.path.insert(0, os.getcwd())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        from megatron_cpu import patch_for_cpu

        from slime.backends.megatron_utils.worker import CPU_TESTING_ENV

        patch_for_cpu()
        os.environ[CPU_TESTING_ENV] = "1"
    from slime.backends.megatron_utils.worker import MegatronTrainWorker
    from slime.utils.arguments import parse_args
    from tests.backends.fsdp_utils.fsdp_test_utils import make_samples, rank_data

    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    argv = ["--train-backend", "megatron", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "4",
            "--hf-checkpoint", cli.hf_dir, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--seed", "0", "--lr", "1e-4", "--save", cli.save,
            "--actor-num-gpus-per-node", str(world), *extra]
    if cli.resume:
        argv += ["--load", cli.save]
    args = parse_args(argv)
    worker = MegatronTrainWorker(args, role=cli.role)
    if cli.no_optimizer:
        return no_optimizer_pass(worker, args, cli, rank, world)
    start = worker.init()
    result = {"start": start, "world": world}
    data = [rank_data(args, make_samples(8, seed=s, vocab=400), dp_size=world, rank=rank) for s in (1, 2)]
    if not cli.resume:
        metrics0 = worker.train(0, data[0])
        result["rollout0"] = {k: v for k, v in metrics0.items() if k.startswith(("train/", "rollout/"))}
        result["rollout0_ppo_kl"] = [m.get("train/ppo_kl") for m in worker.get_step_metrics()]
        worker.save(0)
        if cli.offload and cuda:
            before = torch.cuda.memory_allocated()
            worker.offload()
            result["offload_freed_bytes"] = before - torch.cuda.memory_allocated()
            worker.onload()
    metrics = worker.train(1, data[1])
    result["rollout1"] = {k: v for k, v in metrics.items() if k.startswith("train/")}
    result["rollout1_ppo_kl"] = [m.get("train/ppo_kl") for m in worker.get_step_metrics()]
    result["weights"] = weight_sums(worker)
    if rank == 0:
        with open(cli.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def weight_sums(worker) -> dict[str, float]:
    """Σx + Σx² of every HF-named tensor (the critic: its backbone and its value head)."""
    from slime.backends.megatron_utils import model as mm
    from slime.backends.megatron_utils import pipeline

    named = list(mm.iter_hf_weights(worker.model, worker.layout, torch.float32, skip_prefixes=worker._head_prefixes()))
    if worker.role == "critic":
        gpt = mm.unwrap(worker.model)
        head = {f"value_head.{k}": v.detach().float().cpu() for k, v in gpt.output_layer.named_parameters()} \
            if getattr(gpt, "post_process", False) else None
        named += list(pipeline.broadcast_from_last_stage(head).items())
    return {name: float(t.double().sum()) + float((t.double() ** 2).sum()) for name, t in named}


def no_optimizer_pass(worker, args, cli, rank: int, world: int) -> None:
    """compute_log_probs + advantages + the first optimizer step's forward/backward and
    finalize_model_grads, through the worker's own code; records per-sample log-probs (the
    critic: values), the step's reduced metrics and every parameter's reduced gradient (HF-named,
    full; the critic's value head excluded)."""
    from megatron.core.distributed import finalize_model_grads

    from slime.backends.megatron_utils import model as mm
    from tests.backends.fsdp_utils.fsdp_test_utils import make_samples, rank_data

    worker._build_optimizer = lambda: (None, None)
    worker.init()
    data = worker._merge_model_parallel_shards(rank_data(args, make_samples(8, seed=1, vocab=400), dp_size=world, rank=rank))
    prepared = worker.prepare(0, data)
    worker.ddp_model.zero_grad_buffer()
    sums, _, _ = worker.forward_backward(prepared, 0)
    finalize_model_grads([worker.ddp_model])
    metrics = worker._all_reduce_sums(sums, worker.step_normaliser(prepared, 0))
    rollout = worker._rollout_metrics(prepared) if cli.role == "actor" else {}
    # gradients in the HF layout: the same export path as the weights, applied to main_grad
    gpt = mm.unwrap(worker.model)
    saved = {name: p.data.clone() for name, p in gpt.named_parameters()}
    for p in gpt.parameters():
        p.data.copy_(p.main_grad)
    grads = {name: tensor.double() for name, tensor in
             mm.iter_hf_weights(worker.model, worker.layout, torch.float32, skip_prefixes=worker._head_prefixes())}
    for name, p in gpt.named_parameters():
        p.data.copy_(saved[name])
    if cli.role == "critic" and cli.save_hf:
        worker.save_hf(cli.save_hf)
    samples = [int(i) for i in prepared["sample_indices"]] if "sample_indices" in prepared else list(range(len(prepared["tokens"])))
    per_sample = prepared["log_probs"] if cli.role == "actor" else prepared["values"]
    log_probs = {str(k): v.tolist() for k, v in zip(samples, per_sample)}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, log_probs)
    if rank == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        torch.save({"metrics": metrics, "rollout": rollout, "log_probs": merged, "grads": grads}, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

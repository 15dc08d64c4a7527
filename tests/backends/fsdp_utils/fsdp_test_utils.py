"""Shared helpers for the FSDP2 worker tests: args, a tiny rollout batch, one-rank process group."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from slime.arguments import parse_args
from slime.backends.training.train_data import convert_samples_to_train_data, split_train_data_by_dp
from slime.utils.types import Sample


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_rank_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def make_args(model_dir, *extra, rbs=2, n=2):
    return parse_args(
        ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "4",
         "--hf-checkpoint", str(model_dir), "--rollout-batch-size", str(rbs), "--n-samples-per-prompt", str(n),
         "--seed", "0", *extra]
    )


def make_samples(num: int, seed: int = 0, rewards=None, vocab: int = 500) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        prompt = int(torch.randint(3, 7, (1,), generator=g))
        response = int(torch.randint(2, 6, (1,), generator=g))
        tokens = torch.randint(10, vocab, (prompt + response,), generator=g).tolist()
        reward = float(rewards[i]) if rewards is not None else float(torch.rand(1, generator=g))
        samples.append(Sample(index=i, group_index=i // 2, tokens=tokens, response_length=response, reward=reward,
                              status=Sample.Status.COMPLETED, rollout_log_probs=[-1.0] * response))
    return samples


def rank_data(args, samples, dp_size=1, rank=0):
    data = convert_samples_to_train_data(args, samples)
    return split_train_data_by_dp(args, data, dp_size)[rank]


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def step_zero_gradients(worker, rollout_data, rollout_metrics: bool = False):
    """(reduced step-0 metrics and rollout/* metrics, full gradients) of one optimizer step's forward/backward, no update."""
    prepared = worker.prepare(0, rollout_data)
    worker.backend.optimizer.zero_grad(set_to_none=True)
    sums, _, _ = worker.forward_backward(prepared, 0)
    reduced = worker.reduce_sums(sums, worker.step_normaliser(prepared, 0))
    if rollout_metrics:  # rollout/*: the same on 1 rank and on N
        reduced.update(worker.rollout_metrics(prepared))
    grads = full_grads(worker.backend.model)
    worker.backend.optimizer.zero_grad(set_to_none=True)
    return reduced, grads


def spawned_step_gradients(rank, world_size, port, model_dir, extra, num_samples, rbs, out_path):
    """Entry point for torch.multiprocessing.spawn: FSDP2 over ``world_size`` gloo ranks."""
    from slime.backends.training.worker import TrainWorker

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        args = make_args(model_dir, *extra, rbs=rbs)
        worker = TrainWorker(args)
        worker.init()
        data = rank_data(args, make_samples(num_samples, seed=1), dp_size=world_size, rank=rank)
        reduced, grads = step_zero_gradients(worker, data, rollout_metrics=True)
        if rank == 0:
            torch.save({"reduced": reduced, "grads": grads}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def regrouped(batch, micro_batches: list[list[int]]):
    """``batch`` with its samples packed into ``micro_batches`` instead (for forward-only comparisons)."""
    import dataclasses

    return batch.replace(schedule=dataclasses.replace(batch.schedule, micro_batch_indices=micro_batches))

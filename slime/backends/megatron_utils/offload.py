"""Offload/onload of a Megatron trainer's device memory for colocated mode (the manual path).

Parameters (the DDP parameter buffers), gradient buffers and optimizer state go to host memory and
their device storage is freed; onload restores the same storage in place, so every view of it (the
model's parameters, the distributed optimizer's shards) stays valid. ``torch_memory_saver`` (which
would keep the virtual addresses and release the physical pages) is not used yet.
"""

from __future__ import annotations

import torch

__all__ = ["offload_to_host", "onload_from_host", "inner_optimizers"]


def inner_optimizers(optimizer):
    """The torch optimizers inside a Megatron-Core optimizer (chained or not)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            yield inner


def _optimizer_states(optimizer):
    for inner in inner_optimizers(optimizer):
        yield from inner.state.values()


def offload_to_host(ddp_model, optimizer) -> dict:
    """Move to host memory; returns the host copies of the parameter buffers (for onload)."""
    host = {}
    ddp_model.offload_grad_buffers(synchronize=True, empty_cache=False)
    for i, buffer in enumerate(ddp_model.buffers + ddp_model.expert_parallel_buffers):
        host[i] = buffer.param_data.to("cpu", non_blocking=True)
        buffer.param_data.untyped_storage().resize_(0)
    for state in _optimizer_states(optimizer):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                state[key] = value.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return host


def onload_from_host(ddp_model, optimizer, host: dict, device) -> None:
    for i, buffer in enumerate(ddp_model.buffers + ddp_model.expert_parallel_buffers):
        saved = host[i]
        buffer.param_data.untyped_storage().resize_(saved.numel() * saved.element_size())
        buffer.param_data.copy_(saved, non_blocking=True)
    ddp_model.restore_grad_buffers(synchronize=True)
    for state in _optimizer_states(optimizer):
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not value.is_cuda and key != "step":
                state[key] = value.to(device, non_blocking=True)
    torch.cuda.synchronize()

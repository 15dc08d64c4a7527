"""Megatron checkpoints: the seed's directory semantics and the torch_dist format.

Layout under a checkpoint root (``--save``, ``--load``, ``--ref-load``)::

    latest_checkpointed_iteration.txt     the last complete iteration (rollout id), written last
    iter_0000007/                         Megatron distributed checkpoint (torch_dist): model,
                                          optimizer and scheduler of every rank, resharding-safe
    iter_0000007/slime_extra_rank{r}.pt   global step and RNG states of rank r

Which checkpoint an actor starts from (after :func:`slime.arguments.validate_args` rule 5):

* ``--load`` holds ``latest_checkpointed_iteration.txt`` → resume: model, optimizer, scheduler,
  RNG, and the rollout id that follows;
* otherwise validation has already pointed ``--load`` at ``--ref-load`` with ``no_load_optim`` /
  ``no_load_rng`` / ``finetune`` set → the weights only, starting at rollout 0;
* a directory with ``config.json`` (an HF checkpoint) is read with the HF loader instead;
* ``--ckpt-step N`` picks ``iter_{N:07d}`` instead of the latest (``--ref-ckpt-step`` for the ref).

The directory logic is plain Python (tested on CPU); saving and loading call Megatron's
``dist_checkpointing`` and run where the model does.
"""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

from slime.backends.megatron_utils.offload import inner_optimizers

LATEST_FILE = "latest_checkpointed_iteration.txt"

__all__ = ["LATEST_FILE", "iteration_dir", "read_latest_iteration", "resolve_checkpoint", "CheckpointChoice",
           "write_latest_iteration", "is_hf_dir", "save_checkpoint", "load_checkpoint"]


def is_hf_dir(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "config.json"))


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> int | None:
    """The iteration in ``latest_checkpointed_iteration.txt``, or None when there is none."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":  # Megatron's marker for a converted checkpoint
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number, found {text!r}") from None


def write_latest_iteration(root: str, iteration: int) -> None:
    """Atomically record ``iteration`` as complete (after every rank has written it)."""
    tmp = os.path.join(root, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
    os.replace(tmp, os.path.join(root, LATEST_FILE))


class CheckpointChoice:
    """What to load: ``kind`` is ``"megatron"`` (``path`` = iteration dir), ``"hf"`` (``path`` =
    HF dir) or ``"none"`` (random init, no checkpoint); ``resume`` means optimizer/RNG/step too."""

    def __init__(self, kind: str, path: str | None = None, iteration: int | None = None, resume: bool = False):
        self.kind, self.path, self.iteration, self.resume = kind, path, iteration, resume

    def __repr__(self) -> str:
        return f"CheckpointChoice({self.kind!r}, {self.path!r}, iteration={self.iteration}, resume={self.resume})"


def resolve_checkpoint(load: str | None, ckpt_step: int | None = None, finetune: bool = False) -> CheckpointChoice:
    """Map ``--load`` (as resolved by validation) and ``--ckpt-step`` to what to read.

    ``finetune`` (set when ``--load`` had no checkpoint and fell back to ``--ref-load``) means
    weights only. Errors name the directory and what was expected."""
    if not load:
        return CheckpointChoice("none")
    if is_hf_dir(load):
        return CheckpointChoice("hf", load, None, resume=False)
    if not os.path.isdir(load):
        raise FileNotFoundError(f"checkpoint directory {load!r} does not exist")
    iteration = ckpt_step if ckpt_step is not None else read_latest_iteration(load)
    if iteration is None:
        if os.path.isdir(os.path.join(load, "release")):
            return CheckpointChoice("megatron", os.path.join(load, "release"), 0, resume=False)
        raise FileNotFoundError(
            f"{load} holds no checkpoint: no {LATEST_FILE}, no iter_*/ named by --ckpt-step, and no config.json "
            f"(convert an HF model with tools/convert_hf_to_torch_dist.py, or point --ref-load at an HF directory)"
        )
    path = iteration_dir(load, iteration)
    if not os.path.isdir(path):
        available = sorted(d for d in os.listdir(load) if d.startswith("iter_"))
        raise FileNotFoundError(f"{path} does not exist (--ckpt-step {ckpt_step}); {load} has {available or 'no iter_* dirs'}")
    return CheckpointChoice("megatron", path, iteration, resume=not finetune)


# --------------------------------------------------------------------------- torch_dist save / load

# Megatron-Core 0.19's default optimizer layout ("fully_sharded_model_space") needs flattened
# ShardedTensor ranges that its own validation rejects; "dp_reshardable" saves each buffer's shard
# (model weights stay freely reshardable; optimizer state needs the same TP/PP to resume)
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

def _rng_state() -> dict:
    import numpy as np

    from megatron.core import tensor_parallel

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    import numpy as np

    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _adam_step(optimizer) -> float | None:
    """The optimizer's step count (torch Adam keeps one per parameter state; all equal)."""
    holders = [h for inner in inner_optimizers(optimizer) for h in (*inner.state.values(), *inner.param_groups)]
    steps = {float(h["step"]) for h in holders if "step" in h}
    return max(steps) if steps else None


def _set_adam_step(optimizer, step: float) -> None:
    """Megatron-Core's distributed-optimizer load (without Apex/Transformer Engine) leaves torch
    Adam's per-parameter ``step`` at the 1 of the dummy step that allocated the state, so the bias
    correction of the first resumed update would be wrong; the saved count is put back (per
    parameter state, and in the param groups where Transformer Engine's Adam keeps it)."""
    for inner in inner_optimizers(optimizer):
        for holder in (*inner.state.values(), *inner.param_groups):
            value = holder.get("step")
            if value is not None:
                holder["step"] = torch.full_like(value, step) if isinstance(value, torch.Tensor) else type(value)(step)


def save_checkpoint(root: str, iteration: int, model, optimizer=None, scheduler=None, global_step: int = 0) -> str:
    """Collective: write ``iter_{iteration:07d}`` in torch_dist format, then the latest marker."""
    from megatron.core import dist_checkpointing

    from slime.backends.megatron_utils.model import unwrap

    directory = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    state = {"model": unwrap(model).sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=_OPTIMIZER_METADATA)
    dist_checkpointing.save(state, directory)
    extra = {"iteration": iteration, "global_step": global_step, "rng": _rng_state(),
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "adam_step": _adam_step(optimizer) if optimizer is not None else None}
    torch.save(extra, os.path.join(directory, f"slime_extra_rank{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        write_latest_iteration(root, iteration)
    dist.barrier()
    return directory


@torch.no_grad()  # the optimizer copies into views of the parameters
def load_checkpoint(choice: CheckpointChoice, model, optimizer=None, scheduler=None, load_rng: bool = True) -> dict:
    """Collective load of a ``"megatron"`` choice; optimizer/scheduler/RNG only when ``choice.resume``.
    Returns the extra state (``iteration``, ``global_step``) or {}."""
    from megatron.core import dist_checkpointing

    from slime.backends.megatron_utils.model import unwrap

    gpt = unwrap(model)
    state = {"model": gpt.sharded_state_dict()}
    if choice.resume and optimizer is not None:
        # a fresh Adam has no state to load into; Megatron fills it with one zero-gradient step
        # (the model and optimizer tensors are then overwritten by the checkpoint)
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
                inner._init_optimizer_states_with_dummy_values()
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True, metadata=_OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(state, choice.path, strict="assume_ok_unexpected")
    gpt.load_state_dict(loaded["model"], strict=False)
    if "optimizer" in loaded:
        optimizer.load_state_dict(loaded["optimizer"])
    extra_path = os.path.join(choice.path, f"slime_extra_rank{dist.get_rank()}.pt")
    if not choice.resume or not os.path.exists(extra_path):
        return {}
    extra = torch.load(extra_path, weights_only=False)
    if scheduler is not None and extra.get("scheduler") is not None:
        scheduler.load_state_dict(extra["scheduler"])
    if "optimizer" in loaded and extra.get("adam_step") is not None:
        _set_adam_step(optimizer, extra["adam_step"])
    if load_rng:
        _set_rng_state(extra["rng"])
    return extra

"""Checkpoints (torch.distributed.checkpoint), HF export and weight buckets for the FSDP2 trainer.

Layout under the checkpoint root (``--save``; the critic uses ``<save>/critic``)::

    latest_checkpointed_iteration.txt        the last complete rollout id (written last, by rank 0)
    iter_0000007/dcp/                        DCP shards: {"model": ..., "optim": ..., "old_actor": ... (--keep-old-actor)}
    iter_0000007/extra_state_rank{r}.pt      scheduler, global step, RNG states of rank r

``--async-save`` (:class:`AsyncCheckpointWriter`): the state is copied to host memory (DCP's stager)
before ``save`` returns, and written by a background thread while the next step trains; the latest
marker moves only after every rank finished writing, so a run killed mid-write resumes from the
previous checkpoint. The next save, and the end of the run, wait for the write in flight.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import shutil
import threading
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"

__all__ = ["LATEST_FILE", "AsyncCheckpointWriter", "is_hf_dir", "save_checkpoint", "load_checkpoint", "save_hf",
           "named_hf_weights", "full_state_dict"]


class CheckpointedBackend(Protocol):
    """What these functions read and set of :class:`slime.backends.fsdp_utils.backend.FSDPBackend` (which
    imports this module)."""

    args: Any
    role: str
    rank: int
    model: torch.nn.Module
    old_actor: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    global_step: int
    _old_actor_loaded: bool


def is_hf_dir(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "config.json"))


def _iteration_dir(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"iter_{rollout_id:07d}")


def _rng_state() -> dict:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _prepare(backend: CheckpointedBackend, root: str | None, rollout_id: int) -> tuple[str, dict, dict]:
    """Collective: the iteration directory (created), the DCP state and the per-rank extra state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not root:
        raise ValueError("save needs --save (the checkpoint directory)")
    directory = _iteration_dir(root, rollout_id)
    if backend.rank == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    state = {"model": model_state}
    if not backend.args.no_save_optim:
        state["optim"] = optim_state
    if getattr(backend, "old_actor", None) is not None:  # --keep-old-actor: π_old of the next step
        state["old_actor"] = get_model_state_dict(backend.old_actor)
    extra = {"scheduler": backend.scheduler.state_dict(), "global_step": backend.global_step, "rng": _rng_state(),
             "rollout_id": rollout_id}
    return directory, state, extra


def _write_latest(root: str, rollout_id: int) -> None:
    tmp = os.path.join(root, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(rollout_id))
    os.replace(tmp, os.path.join(root, LATEST_FILE))


def save_checkpoint(backend: CheckpointedBackend, root: str | None, rollout_id: int) -> str:
    """Collective save of model, optimizer, scheduler, step and RNG; returns the iteration dir."""
    import torch.distributed.checkpoint as dcp

    directory, state, extra = _prepare(backend, root, rollout_id)
    dcp.save(state, checkpoint_id=os.path.join(directory, "dcp"))
    torch.save(extra, os.path.join(directory, f"extra_state_rank{backend.rank}.pt"))
    dist.barrier()
    if backend.rank == 0:
        _write_latest(root, rollout_id)
    dist.barrier()
    return directory


class AsyncCheckpointWriter:
    """``--async-save``: one checkpoint written in the background at a time.

    ``save`` is collective and returns once this rank's state is a private copy in host memory (so
    the next step may change the parameters and optimizer state); a thread then writes it, through a
    gloo process group of its own (the training collectives run meanwhile on the default group),
    waits for every rank, and rank 0 moves the latest marker. ``wait`` joins that thread and
    re-raises a failed write; ``save`` calls it first.
    """

    def __init__(self):
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.in_flight: int | None = None  # the rollout id being written

    def save(self, backend: CheckpointedBackend, root: str | None, rollout_id: int) -> str:
        import torch.distributed.checkpoint as dcp

        self.wait()
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank saves
        directory, state, extra = _prepare(backend, root, rollout_id)
        upload = dcp.async_save(state, checkpoint_id=os.path.join(directory, "dcp"), process_group=self._group)
        extra = copy.deepcopy(extra)  # the scheduler's and RNG state of now, not of when the write ends
        self.in_flight = rollout_id
        self._thread = threading.Thread(target=self._finish, args=(upload, extra, directory, root, rollout_id, backend.rank),
                                        name=f"async-save[{rollout_id}]", daemon=True)
        self._thread.start()
        return directory

    def _finish(self, upload, extra: dict, directory: str, root: str, rollout_id: int, rank: int) -> None:
        try:
            upload.result()
            torch.save(extra, os.path.join(directory, f"extra_state_rank{rank}.pt"))
            dist.barrier(group=self._group)  # every rank's shards are on disk
            if rank == 0:
                _write_latest(root, rollout_id)
            logger.info("async checkpoint of rollout %d written to %s", rollout_id, directory)
        except BaseException as e:  # reported by wait(), in the training thread
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread, self.in_flight = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"--async-save: writing the checkpoint failed: {error}") from error


def load_checkpoint(backend: CheckpointedBackend, root: str, no_load_optim: bool = False, no_load_rng: bool = False) -> int:
    """Collective load of the latest checkpoint under ``root``; returns its rollout id. Parameters saved
    without optimizer state (no gradient before the save) resume without it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    with open(os.path.join(root, LATEST_FILE)) as f:
        rollout_id = int(f.read().strip())
    directory = _iteration_dir(root, rollout_id)
    saved = _saved_keys(directory)
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    load_optim = not no_load_optim and any(key.startswith("optim.") for key in saved)
    if load_optim:
        optim_state = _saved_optimizer_state(optim_state, saved)
    state = {"model": model_state, **({"optim": optim_state} if load_optim else {})}
    load_old_actor = getattr(backend, "old_actor", None) is not None and any(key.startswith("old_actor.") for key in saved)
    if load_old_actor:
        state["old_actor"] = get_model_state_dict(backend.old_actor)
    dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
    set_model_state_dict(backend.model, state["model"])
    if load_optim:  # not strict: the parameters saved without state (checked above) stay without it
        set_optimizer_state_dict(backend.model, backend.optimizer, state["optim"], options=StateDictOptions(strict=False))
    if load_old_actor:
        set_model_state_dict(backend.old_actor, state["old_actor"])
        backend._old_actor_loaded = True
    extra_path = os.path.join(directory, f"extra_state_rank{backend.rank}.pt")
    if os.path.exists(extra_path):
        extra = torch.load(extra_path, weights_only=False)
        if load_optim:
            backend.scheduler.load_state_dict(extra["scheduler"])
            backend.global_step = int(extra["global_step"])
        if not no_load_rng:
            _set_rng_state(extra["rng"])
    return rollout_id


def _saved_keys(directory: str) -> set[str]:
    """The flattened keys of the DCP checkpoint in ``directory`` (empty when it holds none)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.exists(os.path.join(directory, "dcp")):
        return set()
    return set(FileSystemReader(os.path.join(directory, "dcp")).read_metadata().state_dict_metadata)


def _saved_optimizer_state(template: dict, saved: set[str]) -> dict:
    """The load template's optimizer entries that the checkpoint holds.

    Adam creates a parameter's state at the first step that gives it a gradient, so a parameter that
    had none before the save (outside the loss's graph so far) is saved without state; the template
    of a fresh optimizer has state for every parameter (DCP's initialising step), and asking for the
    missing entries would fail the load. Such a parameter resumes stateless, as it was."""
    state = {}
    for fqn, entries in template["state"].items():
        missing = [key for key in entries if f"optim.state.{fqn}.{key}" not in saved]
        if not missing:
            state[fqn] = entries
        elif len(missing) < len(entries):
            raise ValueError(f"the checkpoint's optimizer state of {fqn} lacks {missing}: it was not written by this "
                             "optimizer; resume with --no-load-optim to start the optimizer afresh")
    return {**template, "state": state}


def full_state_dict(backend: CheckpointedBackend) -> dict[str, torch.Tensor]:
    """Full (unsharded) model state dict on CPU, on rank 0 only (empty elsewhere); collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _drop_tied(state: dict, config) -> dict:
    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.jinja", "chat_template.json")


def save_hf(backend: CheckpointedBackend, path: str) -> None:
    """HF directory readable by ``from_pretrained``: safetensors weights, config, generation config
    and tokenizer (copied from ``--hf-checkpoint``). The critic also writes ``value_head.safetensors``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    state = full_state_dict(backend)
    if backend.rank == 0:
        os.makedirs(path, exist_ok=True)
        source = backend.args.hf_checkpoint
        config = AutoConfig.from_pretrained(source)
        if backend.role == "critic":
            head = {k[len("value_head."):]: v for k, v in state.items() if k.startswith("value_head.")}
            save_file({k: v.contiguous() for k, v in head.items()}, os.path.join(path, "value_head.safetensors"))
            state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
            state = {f"model.{k}": v for k, v in state.items()}
        state = _drop_tied(state, config)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(path)
        try:
            GenerationConfig.from_pretrained(source).save_pretrained(path)
        except OSError:
            pass  # the source has no generation_config.json
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
        for name in PROCESSOR_FILES:  # a vision-language model's image processor and chat template
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
    dist.barrier()


def named_hf_weights(backend: CheckpointedBackend, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors, all-gathered from the FSDP shards one at a time, on every rank, on the
    training device. The tied ``lm_head.weight`` is skipped when the config ties it to the embeddings."""
    config = getattr(backend.model, "config", None)
    for name, tensor in _drop_tied(backend.model.state_dict(), config).items():
        if hasattr(tensor, "full_tensor") and tensor.device_mesh.size() == 1:
            full = tensor.to_local()  # one rank holds the whole tensor: no redistribution (~0.1 ms a tensor on CPU)
        else:
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        full = full.detach()
        yield name, (full.to(dtype) if dtype is not None else full)

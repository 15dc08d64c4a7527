"""Checkpoints (torch.distributed.checkpoint), HF export and weight buckets for the FSDP2 trainer.

Layout under the checkpoint root (``--save``; the critic uses ``<save>/critic``)::

    latest_checkpointed_iteration.txt        the last complete rollout id (written last, by rank 0)
    iter_0000007/dcp/                        DCP shards: {"model": ..., "optim": ..., "old_actor": ... (--keep-old-actor)}
    iter_0000007/extra_state_rank{r}.pt      scheduler, global step, RNG states of rank r
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from slime.backends.fsdp_utils.backend import FSDPBackend

LATEST_FILE = "latest_checkpointed_iteration.txt"

__all__ = ["LATEST_FILE", "is_hf_dir", "save_checkpoint", "load_checkpoint", "save_hf", "named_hf_weights", "full_state_dict"]


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


def save_checkpoint(backend: "FSDPBackend", root: str | None, rollout_id: int) -> str:
    """Collective save of model, optimizer, scheduler, step and RNG; returns the iteration dir."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not root:
        raise ValueError("save needs --save (the checkpoint directory)")
    directory = _iteration_dir(root, rollout_id)
    if backend.rank == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    state = {"model": model_state}
    if not getattr(backend.args, "no_save_optim", False):
        state["optim"] = optim_state
    if getattr(backend, "old_actor", None) is not None:  # --keep-old-actor: π_old of the next step
        state["old_actor"] = get_model_state_dict(backend.old_actor)
    dcp.save(state, checkpoint_id=os.path.join(directory, "dcp"))
    extra = {"scheduler": backend.scheduler.state_dict(), "global_step": backend.global_step, "rng": _rng_state(),
             "rollout_id": rollout_id}
    torch.save(extra, os.path.join(directory, f"extra_state_rank{backend.rank}.pt"))
    dist.barrier()
    if backend.rank == 0:
        tmp = os.path.join(root, LATEST_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(rollout_id))
        os.replace(tmp, os.path.join(root, LATEST_FILE))
    dist.barrier()
    return directory


def load_checkpoint(backend: "FSDPBackend", root: str, no_load_optim: bool = False, no_load_rng: bool = False) -> int:
    """Collective load of the latest checkpoint under ``root``; returns its rollout id."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

    with open(os.path.join(root, LATEST_FILE)) as f:
        rollout_id = int(f.read().strip())
    directory = _iteration_dir(root, rollout_id)
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer)
    load_optim = not no_load_optim and os.path.exists(os.path.join(directory, "dcp")) and _has_optim(directory)
    state = {"model": model_state, **({"optim": optim_state} if load_optim else {})}
    load_old_actor = getattr(backend, "old_actor", None) is not None and _has_key(directory, "old_actor")
    if load_old_actor:
        state["old_actor"] = get_model_state_dict(backend.old_actor)
    dcp.load(state, checkpoint_id=os.path.join(directory, "dcp"))
    set_state_dict(backend.model, backend.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"] if load_optim else {})
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


def _has_optim(directory: str) -> bool:
    return _has_key(directory, "optim")


def _has_key(directory: str, prefix: str) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(os.path.join(directory, "dcp")).read_metadata()
    return any(key.startswith(prefix) for key in metadata.state_dict_metadata)


def full_state_dict(backend: "FSDPBackend") -> dict[str, torch.Tensor]:
    """Full (unsharded) model state dict on CPU, on rank 0 only (empty elsewhere); collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _drop_tied(state: dict, config) -> dict:
    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state


def save_hf(backend: "FSDPBackend", path: str) -> None:
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
    dist.barrier()


def named_hf_weights(backend: "FSDPBackend", dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors, all-gathered from the FSDP shards one at a time, on every rank, on the
    training device. The tied ``lm_head.weight`` is skipped when the config ties it to the embeddings."""
    config = getattr(backend.model, "config", None)
    for name, tensor in _drop_tied(backend.model.state_dict(), config).items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        full = full.detach()
        yield name, (full.to(dtype) if dtype is not None else full)

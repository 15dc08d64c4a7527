"""Weight-update payloads: the pickled tensor path, flattened buckets, and the broadcast group.

* ``/update_weights_from_tensor``: each entry of ``serialized_named_tensors`` is (base64 of) a
  ``multiprocessing.reduction.ForkingPickler`` pickle (with torch's reductions registered). On CPU the tensors travel as shared
  memory files, which works between unrelated processes only with the ``file_system`` sharing
  strategy (both sides call :func:`use_file_system_sharing`). Unpickling goes through an allow-list
  (:class:`_AllowListUnpickler`), never plain ``pickle.loads``.
* ``load_format="flattened_bucket"``: ``{"flattened_tensor": uint8[N], "metadata":
  [FlattenedTensorMetadata...]}``, byte ranges into the buffer, several dtypes allowed.
* ``/init_weights_update_group``: :func:`init_custom_process_group` builds a torch.distributed group
  outside the default one (TCP rendezvous, store prefixed by the group name), on gloo or NCCL. A
  trainer joins as rank 0 with the same function.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch

ALLOWED_MODULE_PREFIXES = ("torch.", "torch", "builtins", "collections", "numpy.core.multiarray", "numpy",
                           "_codecs", "copyreg", "slime.backends.embedded_engine.weight_loading")


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor lives in a flattened uint8 bucket: bytes ``[start_idx, end_idx)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # byte count, as SGLang's bucket records it


def use_file_system_sharing() -> None:
    """CPU tensors in shared memory must be addressable by file name from an unrelated process."""
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")


def flatten_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """Sender side of ``flattened_bucket``: one uint8 buffer + metadata, tensors concatenated in order."""
    chunks, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tuple(tensor.shape), tensor.dtype, offset,
                                                offset + raw.numel(), raw.numel()))
        chunks.append(raw)
        offset += raw.numel()
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_tensors(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for meta in metadata:
        if meta.end_idx > flat.numel() or meta.start_idx < 0:
            raise ValueError(f"flattened bucket entry {meta.name!r} spans bytes [{meta.start_idx}, {meta.end_idx}) "
                             f"but the buffer holds {flat.numel()} bytes")
        out.append((meta.name, flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return out


def serialize_for_engine(obj) -> str:
    """Sender helper: ForkingPickler bytes, base64 (what goes into ``serialized_named_tensors``)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor/storage reductions)

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not any(module == p or module.startswith(p.rstrip(".") + ".") for p in ALLOWED_MODULE_PREFIXES):
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: module not in the allow-list "
                                         f"{ALLOWED_MODULE_PREFIXES}")
        return super().find_class(module, name)


def deserialize_named_tensors(entry, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """Decode one ``serialized_named_tensors`` entry into (name, tensor) pairs."""
    raw = base64.b64decode(entry) if isinstance(entry, str) else bytes(entry)
    payload = _AllowListUnpickler(io.BytesIO(raw)).load()
    if load_format in (None, "direct"):
        if not isinstance(payload, (list, tuple)):
            raise ValueError(f"load_format {load_format!r} expects a list of (name, tensor), got {type(payload).__name__}")
        return [(str(name), tensor) for name, tensor in payload]
    if load_format == "flattened_bucket":
        if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
            raise ValueError("load_format 'flattened_bucket' expects {'flattened_tensor': uint8 tensor, 'metadata': [...]}")
        return unflatten_tensors(payload["flattened_tensor"], payload["metadata"])
    raise ValueError(f"load_format {load_format!r} is not supported; use null, 'direct' or 'flattened_bucket'")


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta = timedelta(seconds=300)):
    """A process group that does not need (or touch) the default group; both engine and trainer use it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def receive_broadcast(group, names: list[str], dtypes: list[str], shapes: list[list[int]], device: torch.device,
                      flattened: bool) -> list[tuple[str, torch.Tensor]]:
    """Engine side of ``/update_weights_from_distributed``: one broadcast per tensor in list order, or a
    single uint8 broadcast for a flattened bucket. Blocking: run it off the event loop."""
    import torch.distributed as dist

    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length")
    torch_dtypes = []
    for dtype in dtypes:
        resolved = getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtypes: {dtype!r} is not a torch dtype name")
        torch_dtypes.append(resolved)
    if not flattened:
        tensors = [torch.empty(shape, dtype=dt, device=device) for shape, dt in zip(shapes, torch_dtypes)]
        works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        return list(zip(names, tensors))
    metadata, offset = [], 0
    for name, dt, shape in zip(names, torch_dtypes, shapes):
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        metadata.append(FlattenedTensorMetadata(name, tuple(shape), dt, offset, offset + nbytes, nbytes))
        offset += nbytes
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0, group=group)
    return unflatten_tensors(flat, metadata)

"""Weight-update wire formats, shared by the senders (trainer transports) and the embedded engine.

* ``/update_weights_from_tensor``: each entry of ``serialized_named_tensors`` is (base64 of) a
  ``multiprocessing.reduction.ForkingPickler`` pickle (with torch's reductions registered). On CPU
  the tensors travel as shared memory files, which works between unrelated processes only with the
  ``file_system`` sharing strategy (both sides call :func:`use_file_system_sharing`). Unpickling
  goes through an allow-list, never plain ``pickle.loads``.
* ``load_format="flattened_bucket"``: ``{"flattened_tensor": uint8[N], "metadata":
  [FlattenedTensorMetadata...]}``, byte ranges into the buffer, several dtypes allowed.
* ``/init_weights_update_group``: :func:`init_custom_process_group` builds a torch.distributed
  group outside the default one (TCP rendezvous, store prefixed by the group name), on gloo or
  NCCL. A trainer joins as rank 0 with the same function.

Two dialects of the pickle exist. SGLang unpickles with ``SafeUnpickler``, whose allow-list names
exact globals: of SGLang's own classes only ``sglang.srt.weight_sync.tensor_bucket``'s, so a
payload for SGLang must be built from SGLang's ``FlattenedTensorMetadata`` and serialized by its
``MultiprocessingSerializer`` (which, with its torch reduction patch, records CUDA devices by UUID
so the engine maps them to its own device index). Payloads for the embedded engine use slime's
class below. The embedded engine accepts both: SGLang's metadata class is read as slime's when
SGLang is not importable there.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch

SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
ALLOWED_MODULE_PREFIXES = ("torch.", "torch", "builtins", "collections", "numpy.core.multiarray", "numpy",
                           "_codecs", "copyreg", __name__)


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor lives in a flattened uint8 bucket: bytes ``[start_idx, end_idx)``. The same
    fields, in the same order, as SGLang's class of this name."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # byte count, as SGLang's bucket records it


def metadata_class(for_sglang: bool):
    """The metadata class a payload is built from: SGLang's own when SGLang is the target."""
    if not for_sglang:
        return FlattenedTensorMetadata
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as SGLangMetadata
    except ImportError as e:
        raise RuntimeError(
            "weights for SGLang engines (--rollout-backend sglang) are sent as SGLang's own "
            f"{SGLANG_BUCKET_MODULE}.FlattenedTensorMetadata, which SGLang's unpickler allows; SGLang is not "
            f"importable in this trainer process ({e}). Install it here too (`pip install -e '.[sglang]'`)."
        ) from e
    return SGLangMetadata


def use_file_system_sharing() -> None:
    """CPU tensors in shared memory must be addressable by file name from an unrelated process."""
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")


def flatten_tensors(named_tensors: list[tuple[str, torch.Tensor]], for_sglang: bool = False) -> dict:
    """Sender side of ``flattened_bucket``: one uint8 buffer + metadata, tensors concatenated in order."""
    make_metadata = metadata_class(for_sglang)
    chunks, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(make_metadata(name, torch.Size(tensor.shape), tensor.dtype, offset, offset + raw.numel(),
                                      raw.numel()))
        chunks.append(raw)
        offset += raw.numel()
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_tensors(flat: torch.Tensor, metadata) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` for each entry (slime's or SGLang's metadata class)."""
    out = []
    for meta in metadata:
        if meta.end_idx > flat.numel() or meta.start_idx < 0:
            raise ValueError(f"flattened bucket entry {meta.name!r} spans bytes [{meta.start_idx}, {meta.end_idx}) "
                             f"but the buffer holds {flat.numel()} bytes")
        out.append((meta.name, flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return out


def serialize_for_engine(obj, for_sglang: bool = False) -> str:
    """Sender helper: ForkingPickler bytes, base64 (what goes into ``serialized_named_tensors``).
    For SGLang, SGLang's own serializer with its torch reduction patch applied."""
    if for_sglang:
        from sglang.srt.utils.common import MultiprocessingSerializer

        if _holds_cuda_tensor(obj):
            # SGLang's patch names the GPU by UUID (the engine maps it to its own index). It replaces
            # torch's tensor reduction process-wide and handles CUDA tensors only, so it is applied
            # only when a CUDA payload is sent.
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
        return MultiprocessingSerializer.serialize(obj, output_str=True)
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor/storage reductions)

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _holds_cuda_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_holds_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_cuda_tensor(v) for v in obj)
    return False


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata"):
            try:  # SGLang's class where SGLang is installed; slime's (same fields) where it is not
                return super().find_class(module, name)
            except ImportError:
                return FlattenedTensorMetadata
        if not any(module == p or module.startswith(p.rstrip(".") + ".") for p in ALLOWED_MODULE_PREFIXES):
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: module not in the allow-list "
                                         f"{ALLOWED_MODULE_PREFIXES + (SGLANG_BUCKET_MODULE,)}")
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


def _torch_dtypes(dtypes: list[str]) -> list[torch.dtype]:
    resolved = []
    for dtype in dtypes:
        value = getattr(torch, str(dtype).replace("torch.", ""), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"dtypes: {dtype!r} is not a torch dtype name")
        resolved.append(value)
    return resolved


def bucket_nbytes(dtypes: list[str], shapes: list[list[int]]) -> int:
    """Bytes of a flattened bucket of tensors of these dtypes and shapes (what :func:`receive_broadcast` receives)."""
    return sum(torch.Size(shape).numel() * dt.itemsize for dt, shape in zip(_torch_dtypes(dtypes), shapes))


def receive_broadcast(group, names: list[str], dtypes: list[str], shapes: list[list[int]], device: torch.device,
                      flattened: bool, buffer: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
    """Engine side of ``/update_weights_from_distributed``: one broadcast per tensor in list order, or a
    single uint8 broadcast for a flattened bucket, received into the first bytes of ``buffer`` (uint8, on
    ``device``, at least :func:`bucket_nbytes` long; the tensors returned are views of it, so it must stay
    unused until they are loaded) or into a new tensor. Blocking: run it off the event loop."""
    import torch.distributed as dist

    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length")
    torch_dtypes = _torch_dtypes(dtypes)
    if not flattened:
        tensors = [torch.empty(shape, dtype=dt, device=device) for shape, dt in zip(shapes, torch_dtypes)]
        works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
        return list(zip(names, tensors))
    metadata, offset = [], 0
    for name, dt, shape in zip(names, torch_dtypes, shapes):
        nbytes = torch.Size(shape).numel() * dt.itemsize
        metadata.append(FlattenedTensorMetadata(name, tuple(shape), dt, offset, offset + nbytes, nbytes))
        offset += nbytes
    if buffer is not None and (buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < offset
                               or buffer.device != torch.device(device)):
        raise ValueError(f"receive buffer: {offset} uint8 bytes on {device} needed, got {buffer.dtype} "
                         f"{tuple(buffer.shape)} on {buffer.device}")
    flat = buffer[:offset] if buffer is not None else torch.empty(offset, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0, group=group)
    return unflatten_tensors(flat, metadata)

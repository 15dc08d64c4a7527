"""Files of the disk weight sync: safetensors shards read and written as raw bytes, and the
metadata a published version carries in its ``model.safetensors.index.json``.

A safetensors file is an 8-byte little-endian header length, a JSON header (``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, offsets relative to the data section) and the
data section. Reading a shard here loads its data section into one private ``uint8`` array, so a
delta can be applied to it in place and the result written to a new file.

Version metadata (``index["metadata"]["slime_weight_sync"]``)::

    {"format": 1, "kind": "full" | "delta", "chain": str, "base_version": int (delta only; -1 is the
     --hf-checkpoint itself), "checksum": "xxh3-128", "removed": [names],
     "tensors": {name: {"encoding": "raw" | "xor" | "overwrite", "dtype": "BF16", "shape": [...],
                        "checksum": hex digest of the tensor's new bytes}}}

``raw`` tensors are stored under their own name, dtype and shape (a full version holds only these,
so it is an ordinary HF checkpoint); ``xor``/``overwrite`` tensors are stored as 1-D ``U8`` payloads.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
METADATA_KEY = "slime_weight_sync"
FORMAT = 1
BASE_CHECKPOINT_VERSION = -1  # a delta on the --hf-checkpoint every host already has

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_TORCH_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
                "uint16": "U16", "uint32": "U32", "uint64": "U64"}


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def safetensors_dtype(torch_dtype) -> str:
    name = str(torch_dtype).replace("torch.", "")
    if name not in _TORCH_NAMES:
        raise TypeError(f"dtype {name} cannot be written to safetensors")
    return _TORCH_NAMES[name]


def tensor_bytes(tensor) -> np.ndarray:
    """The raw bytes of a torch tensor as a 1-D uint8 numpy array (a view for contiguous CPU tensors)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy()


@dataclass
class TensorEntry:
    dtype: str
    shape: list[int]
    begin: int
    end: int


@dataclass
class Shard:
    """One safetensors file held in memory: ``data`` is its data section, ``entries`` index it."""

    path: str
    entries: dict[str, TensorEntry]
    data: np.ndarray
    metadata: dict | None = None

    def tensor(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        return self.data[entry.begin:entry.end]


def read_shard(path: str) -> Shard:
    """Load a safetensors file, checking that its header and size agree (a truncated file is named)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if 8 + header_len > size:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes; the header alone needs {8 + header_len})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise ValueError(f"{path}: unreadable safetensors header: {exc}") from exc
        metadata = header.pop("__metadata__", None)
        entries = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            expected = int(np.prod(info["shape"], dtype=np.int64)) * DTYPE_SIZES.get(info["dtype"], 0)
            if end - begin != expected:
                raise ValueError(f"{path}: tensor {name} spans {end - begin} bytes, its dtype and shape need {expected}")
            entries[name] = TensorEntry(info["dtype"], list(info["shape"]), begin, end)
        data_size = max((e.end for e in entries.values()), default=0)
        if size != 8 + header_len + data_size:
            raise ValueError(f"{path}: truncated or padded safetensors file: {size} bytes, the header declares "
                             f"{8 + header_len + data_size}")
        data = np.fromfile(f, dtype=np.uint8, count=data_size)
    return Shard(path, entries, data, metadata)


def write_shard(path: str, tensors: list[tuple[str, str, list[int], np.ndarray]], metadata: dict | None = None) -> int:
    """Write ``(name, dtype, shape, bytes)`` tensors as one safetensors file; returns the data bytes."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, _, _, data in tensors:
            f.write(memoryview(np.ascontiguousarray(data)))
    return offset


def checkpoint_weight_map(directory: str) -> dict[str, str]:
    """``{tensor name: shard file name}`` of an HF safetensors checkpoint (sharded or single-file)."""
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(directory, SINGLE_FILE_NAME)
    if os.path.isfile(single):
        with open(single, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        return {name: SINGLE_FILE_NAME for name in header if name != "__metadata__"}
    raise FileNotFoundError(f"{directory} holds neither {INDEX_NAME} nor {SINGLE_FILE_NAME}")


@dataclass
class VersionInfo:
    """What a published ``weight_v{N:06d}/`` says about itself."""

    version: int
    path: str
    kind: str
    chain: str
    checksum: str
    base_version: int | None
    tensors: dict[str, dict]
    weight_map: dict[str, str]
    removed: list[str] = field(default_factory=list)


def read_version(path: str, expected_version: int | None = None) -> VersionInfo:
    index_path = os.path.join(path, INDEX_NAME)
    try:
        with open(index_path) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{index_path} does not exist") from None
    except ValueError as exc:
        raise ValueError(f"{index_path}: not valid JSON ({exc})") from exc
    meta = index.get("metadata", {}).get(METADATA_KEY)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{index_path}: no metadata.{METADATA_KEY} of format {FORMAT}; was it written by slime's "
                         "disk weight sync in delta mode?")
    version = int(index["metadata"].get("weight_version", -2))
    if expected_version is not None and version != expected_version:
        raise ValueError(f"{index_path} declares weight_version {version}, expected {expected_version}")
    return VersionInfo(version=version, path=path, kind=meta["kind"], chain=meta["chain"], checksum=meta["checksum"],
                       base_version=meta.get("base_version"), tensors=meta["tensors"],
                       weight_map=index["weight_map"], removed=list(meta.get("removed", [])))


def write_json_atomic(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)

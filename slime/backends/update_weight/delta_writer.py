"""Trainer side of delta mode: publish each weight version as the bytes that changed.

The writer keeps a snapshot of the last published bytes of every tensor (one extra copy of the
model), seeded from ``--hf-checkpoint`` -- the checkpoint every engine host already has, called
version -1. For each new version it encodes every exported tensor against the snapshot
(:mod:`slime.backends.update_weight.delta`), writes the payloads as safetensors shards (one per
bucket) with the apply metadata in ``model.safetensors.index.json`` (:mod:`weight_files`), and
copies the new bytes into the snapshot.

A version is *full* (an ordinary HF checkpoint, which resets the chain) when there is no usable
snapshot (the HF checkpoint is not safetensors, or a previous write failed half-way) or when the
deltas written since the last full version add up to the model's size: catching up from the newest
full version then never reads more than about two models' worth of files. A tensor whose dtype or
shape differs from the snapshot, or that is new, is stored ``raw`` inside a delta version.
"""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from slime.backends.update_weight import delta
from slime.backends.update_weight.weight_files import (
    BASE_CHECKPOINT_VERSION,
    DTYPE_SIZES,
    FORMAT,
    INDEX_NAME,
    METADATA_KEY,
    checkpoint_weight_map,
    read_shard,
    safetensors_dtype,
    tensor_bytes,
    write_json_atomic,
    write_shard,
)

logger = logging.getLogger(__name__)


class DeltaVersionWriter:
    def __init__(self, hf_checkpoint: str | None, encoding: str = "xor", checksum: str = "xxh3-128",
                 num_workers: int | None = None):
        if encoding not in delta.ENCODINGS:
            raise ValueError(f"--update-weight-delta-encoding {encoding!r}; valid: {', '.join(delta.ENCODINGS)}")
        if checksum not in delta.CHECKSUMS:
            raise ValueError(f"--update-weight-delta-checksum {checksum!r}; valid: {', '.join(delta.CHECKSUMS)}")
        self.encoding, self.checksum = encoding, checksum
        self.chain = uuid.uuid4().hex  # names this writer's versions; a restarted trainer starts a new chain
        self.snapshot: dict[str, tuple[str, list[int], np.ndarray]] | None = None
        self.snapshot_version = BASE_CHECKPOINT_VERSION
        self.wire_since_full = 0
        self.pool = ThreadPoolExecutor(max_workers=num_workers or min(4, os.cpu_count() or 1),
                                       thread_name_prefix="delta-encode")
        if hf_checkpoint:
            self._seed(hf_checkpoint)

    def _seed(self, hf_checkpoint: str) -> None:
        try:
            weight_map = checkpoint_weight_map(hf_checkpoint)
        except FileNotFoundError as exc:
            logger.warning("delta weight sync: %s; the first version will be a full one", exc)
            return
        snapshot = {}
        for file_name in sorted(set(weight_map.values())):
            shard = read_shard(os.path.join(hf_checkpoint, file_name))
            for name, entry in shard.entries.items():
                if weight_map.get(name) == file_name:
                    snapshot[name] = (entry.dtype, entry.shape, shard.tensor(name))
        self.snapshot = snapshot

    @property
    def model_bytes(self) -> int:
        return sum(data.nbytes for _, _, data in (self.snapshot or {}).values())

    def next_is_full(self) -> bool:
        return self.snapshot is None or self.wire_since_full >= max(self.model_bytes, 1)

    def _encode_one(self, name: str, tensor, full: bool):
        """Return ``(name, stored dtype, stored shape, stored bytes, tensor metadata)``; advance the snapshot."""
        new = tensor_bytes(tensor)
        dtype, shape = safetensors_dtype(tensor.dtype), list(tensor.shape)
        info = {"dtype": dtype, "shape": shape, "checksum": delta.checksum(new, self.checksum)}
        base = self.snapshot.get(name)
        same_layout = base is not None and base[0] == dtype and base[1] == shape
        if same_layout and not full:
            payload = delta.encode(self.encoding, new, base[2], DTYPE_SIZES[dtype])
            np.copyto(base[2], new)
            stored = np.frombuffer(payload, dtype=np.uint8)
            return name, "U8", [stored.nbytes], stored, dict(info, encoding=self.encoding)
        if same_layout:
            np.copyto(base[2], new)
        else:
            self.snapshot[name] = (dtype, shape, new.copy())
        return name, dtype, shape, new, dict(info, encoding="raw")

    def write(self, buckets, version: int, directory: str) -> tuple[str, int]:
        """Write version ``version`` into ``directory`` (which must exist); returns (kind, bytes written)."""
        full = self.next_is_full()
        if self.snapshot is None:
            self.snapshot = {}
        base_version = self.snapshot_version
        try:
            tensors, weight_map, written, seen = {}, {}, 0, set()
            for index, bucket in enumerate(buckets):
                shard_name = f"model-{index + 1:05d}.safetensors"
                encoded = list(self.pool.map(lambda item: self._encode_one(item[0], item[1], full), bucket))
                written += write_shard(os.path.join(directory, shard_name), [e[:4] for e in encoded])
                for name, _, _, _, info in encoded:
                    tensors[name] = info
                    weight_map[name] = shard_name
                    seen.add(name)
            removed = sorted(set(self.snapshot) - seen)
            for name in removed:
                del self.snapshot[name]
        except BaseException:
            self.snapshot = None  # half advanced: the next version must be a full one
            raise
        meta = {"format": FORMAT, "kind": "full" if full else "delta", "chain": self.chain, "checksum": self.checksum,
                "tensors": tensors}
        if not full:
            meta.update(base_version=base_version, encoding=self.encoding, removed=removed)
        write_json_atomic(os.path.join(directory, INDEX_NAME),
                          {"metadata": {"total_size": written, "weight_version": version, METADATA_KEY: meta},
                           "weight_map": weight_map})
        self.snapshot_version = version
        self.wire_since_full = 0 if full else self.wire_since_full + written
        return meta["kind"], written

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.snapshot = None

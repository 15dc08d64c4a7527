"""Delta codec for disk weight sync: the bytes that changed between two versions of one tensor.

Pure functions of raw byte buffers (``numpy.uint8`` arrays); no files, HTTP or torch.

* ``xor``: ``payload = zstd(new ^ old)`` over the raw bytes, whatever the dtype. Unchanged bytes are
  zero, so the payload is small when few elements change. Applying it twice reverts (an involution).
* ``overwrite``: the positions of the changed elements and their new values (elements are
  ``itemsize`` bytes wide, e.g. 2 for bf16). Applying it twice is the same as once (idempotent).
  Positions are stored as gaps between consecutive changed elements; gaps and values are split into
  byte planes (all first bytes, then all second bytes, ...) so that zstd finds the runs of zeros in
  the high bytes.

Every payload is compressed with zstd level 1. ``checksum`` digests a tensor's new bytes
(``xxh3-128``, ``blake3`` or ``adler32``); the applier compares it with what it computed.
"""

from __future__ import annotations

import struct
import threading
import zlib

import numpy as np
import zstandard

ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
ZSTD_LEVEL = 1
CHUNK_BYTES = 1 << 20  # xor works through 1 MiB pieces
_OVERWRITE_HEADER = struct.Struct("<QBB")  # number of changed elements, gap width, element width


class DeltaError(ValueError):
    """A payload that cannot be applied (wrong size, corrupt, unknown encoding)."""


def checksum(data: np.ndarray, algorithm: str) -> str:
    """Hex digest of the raw bytes of ``data``."""
    buffer = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128_hexdigest(buffer)
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(buffer, max_threads=1).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(buffer) & 0xFFFFFFFF:08x}"
    raise ValueError(f"unknown checksum {algorithm!r}; valid: {', '.join(CHECKSUMS)}")


_contexts = threading.local()  # zstd contexts are not thread-safe; one pair per thread, reused across tensors


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_contexts, "compressor"):
        _contexts.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return _contexts.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_contexts, "decompressor"):
        _contexts.decompressor = zstandard.ZstdDecompressor()
    return _contexts.decompressor


def _compress(data) -> bytes:
    return _compressor().compress(data)


def _decompress(payload, expected_size: int) -> np.ndarray:
    try:
        raw = _decompressor().decompress(memoryview(payload), max_output_size=expected_size)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"corrupt zstd payload: {exc}") from exc
    return np.frombuffer(raw, dtype=np.uint8)


def _as_bytes(array: np.ndarray) -> np.ndarray:
    if array.dtype != np.uint8 or array.ndim != 1:
        raise TypeError(f"expected a 1-D uint8 byte buffer, got {array.dtype} of shape {array.shape}")
    return array


def _uint_view(array: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"element width must be 1, 2, 4 or 8 bytes, got {itemsize}")
    if array.nbytes % itemsize:
        raise ValueError(f"{array.nbytes} bytes is not a whole number of {itemsize}-byte elements")
    return array.view(f"<u{itemsize}")


def _split_planes(values: np.ndarray) -> np.ndarray:
    """``[a0 a1 b0 b1 ...]`` -> ``[a0 b0 ... a1 b1 ...]`` (byte planes of little-endian integers)."""
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, values.itemsize).T).reshape(-1)


def _join_planes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).reshape(-1).view(f"<u{itemsize}")


# ------------------------------------------------------------------------------------------------ xor
def encode_xor(new: np.ndarray, old: np.ndarray) -> bytes:
    new, old = _as_bytes(new), _as_bytes(old)
    if new.nbytes != old.nbytes:
        raise ValueError(f"xor needs equal sizes, got {new.nbytes} and {old.nbytes} bytes")
    if new.nbytes <= CHUNK_BYTES:
        return _compress(np.bitwise_xor(new, old))
    # chunk by chunk: the xor stays in cache and no tensor-sized temporary is allocated
    compressor = _compressor().compressobj(size=new.nbytes)
    scratch = np.empty(min(CHUNK_BYTES, new.nbytes), dtype=np.uint8)
    parts = []
    for start in range(0, new.nbytes, CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, new.nbytes)
        chunk = scratch[:end - start]
        np.bitwise_xor(new[start:end], old[start:end], out=chunk)
        parts.append(compressor.compress(chunk))
    parts.append(compressor.flush())
    return b"".join(parts)


def apply_xor(target: np.ndarray, payload) -> None:
    """``target ^= decompressed payload``, in place (a corrupt payload may leave ``target`` half-applied;
    callers apply to a private copy)."""
    target = _as_bytes(target)
    if target.nbytes <= CHUNK_BYTES:
        try:
            declared = zstandard.frame_content_size(memoryview(payload))
        except zstandard.ZstdError as exc:
            raise DeltaError(f"corrupt zstd payload: {exc}") from exc
        if declared >= 0 and declared != target.nbytes:
            raise DeltaError(f"xor payload holds {declared} bytes, the tensor has {target.nbytes}")
        diff = _decompress(payload, target.nbytes)
        if diff.nbytes != target.nbytes:
            raise DeltaError(f"xor payload holds {diff.nbytes} bytes, the tensor has {target.nbytes}")
        np.bitwise_xor(target, diff, out=target)
        return
    reader = _decompressor().stream_reader(memoryview(payload), read_across_frames=False)
    scratch = np.empty(min(CHUNK_BYTES, max(target.nbytes, 1)), dtype=np.uint8)
    position = 0
    try:
        while True:
            count = reader.readinto(scratch)
            if not count:
                break
            if position + count > target.nbytes:
                raise DeltaError(f"xor payload holds more than the tensor's {target.nbytes} bytes")
            np.bitwise_xor(target[position:position + count], scratch[:count], out=target[position:position + count])
            position += count
    except zstandard.ZstdError as exc:
        raise DeltaError(f"corrupt zstd payload: {exc}") from exc
    if position != target.nbytes:
        raise DeltaError(f"xor payload holds {position} bytes, the tensor has {target.nbytes}")


# ------------------------------------------------------------------------------------------ overwrite
def encode_overwrite(new: np.ndarray, old: np.ndarray, itemsize: int) -> bytes:
    new_items, old_items = _uint_view(_as_bytes(new), itemsize), _uint_view(_as_bytes(old), itemsize)
    if new_items.size != old_items.size:
        raise ValueError(f"overwrite needs equal sizes, got {new.nbytes} and {old.nbytes} bytes")
    positions = np.flatnonzero(new_items != old_items)
    gaps = np.diff(positions, prepend=0)  # the first gap is the first position itself
    gap_width = 4 if new_items.size < 2**32 else 8
    header = _OVERWRITE_HEADER.pack(positions.size, gap_width, itemsize)
    body = [header, _split_planes(gaps.astype(f"<u{gap_width}")), _split_planes(new_items[positions])]
    return _compress(b"".join(memoryview(part) for part in body))


def apply_overwrite(target: np.ndarray, payload, itemsize: int) -> None:
    """Write the payload's values at its positions of ``target``, in place."""
    items = _uint_view(_as_bytes(target), itemsize)
    limit = _OVERWRITE_HEADER.size + items.size * (8 + itemsize)
    raw = _decompress(payload, limit)
    if raw.nbytes < _OVERWRITE_HEADER.size:
        raise DeltaError("overwrite payload is shorter than its header")
    count, gap_width, width = _OVERWRITE_HEADER.unpack_from(raw)
    if width != itemsize or gap_width not in (4, 8):
        raise DeltaError(f"overwrite payload is for {width}-byte elements with {gap_width}-byte gaps; "
                         f"the tensor has {itemsize}-byte elements")
    if raw.nbytes != _OVERWRITE_HEADER.size + count * (gap_width + itemsize):
        raise DeltaError(f"overwrite payload of {raw.nbytes} bytes does not hold {count} changed elements")
    start = _OVERWRITE_HEADER.size
    gaps = _join_planes(raw[start:start + count * gap_width], gap_width)
    values = _join_planes(raw[start + count * gap_width:], itemsize)
    positions = np.cumsum(gaps, dtype=np.uint64)
    if count and int(positions[-1]) >= items.size:
        raise DeltaError(f"overwrite payload writes element {int(positions[-1])} of a tensor of {items.size}")
    items[positions] = values


# ------------------------------------------------------------------------------------------- by name
def encode(encoding: str, new: np.ndarray, old: np.ndarray, itemsize: int) -> bytes:
    if encoding == "xor":
        return encode_xor(new, old)
    if encoding == "overwrite":
        return encode_overwrite(new, old, itemsize)
    raise ValueError(f"unknown delta encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")


def apply(encoding: str, target: np.ndarray, payload, itemsize: int) -> None:
    if encoding == "xor":
        apply_xor(target, payload)
    elif encoding == "overwrite":
        apply_overwrite(target, payload, itemsize)
    else:
        raise DeltaError(f"unknown delta encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")

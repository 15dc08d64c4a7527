"""HF-named tensors grouped into buckets for the weight-update transports (DESIGN §5)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

__all__ = ["bucket_weights"]


def bucket_weights(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive ``(name, tensor)`` pairs in buckets of at most ``bucket_bytes`` (a larger tensor
    forms a bucket of its own). Lazy: a tensor is produced only when its bucket is being filled."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes (--update-weight-buffer-size)")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket

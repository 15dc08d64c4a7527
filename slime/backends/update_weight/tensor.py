"""Colocated transport: tensors handed to the engine by handle (``/update_weights_from_tensor``).

On CPU the bucket is one flattened uint8 tensor in shared memory (``file_system`` sharing, so an
unrelated engine process can map it); on GPU torch pickles CUDA-IPC handles. A CPU payload is pickled
once per engine: each pickling takes a reference on the shared-memory file that the receiving engine
gives back, so one pickle read by two engines gives back one too many and the file is unlinked before
the next push. The buffer is kept alive until every engine has answered, since the engine copies from
it while handling the request.
For SGLang engines (``--rollout-backend sglang``) the payload is built from SGLang's own metadata class
and serializer, the only ones its unpickler accepts (``wire_format``).
"""

from __future__ import annotations

import time

import torch

from slime.backends.update_weight.engine_client import EngineClient
from slime.backends.update_weight.wire_format import (
    flatten_tensors,
    metadata_class,
    serialize_for_engine,
    use_file_system_sharing,
)


class TensorWeightUpdater:
    def __init__(self, args, engine_urls: list[str], engine_gpu_counts: list[int]):
        self.args = args
        self.client = EngineClient(engine_urls)
        self.engine_gpu_counts = engine_gpu_counts
        self._staging: torch.Tensor | None = None  # CPU: one shared-memory buffer reused for every bucket
        self.timings: dict[str, float] = {}  # the last update's phases (update)
        self.for_sglang = args.rollout_backend == "sglang"
        self._metadata = metadata_class(self.for_sglang)  # fails here, at set-up, if SGLang's class is missing
        use_file_system_sharing()

    def _stage_on_cpu(self, bucket) -> dict:
        """Copy the bucket once into a persistent shared-memory buffer. Reusing the same storage lets the
        engine keep its mapping of it (torch caches received shared storages), so each update costs one
        copy on each side instead of concatenate + move-to-shared + fresh page faults."""
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        total = sum(sizes)
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8).share_memory_()
        metadata, offset = [], 0
        for (name, tensor), size in zip(bucket, sizes):
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self._staging[offset:offset + size].copy_(raw)
            metadata.append(self._metadata(name, torch.Size(tensor.shape), tensor.dtype, offset, offset + size, size))
            offset += size
        return {"flattened_tensor": self._staging[:total], "metadata": metadata}

    def update(self, buckets, weight_version: str) -> int:
        """Send every bucket; return the number of bytes sent to each engine. ``timings`` holds the seconds
        of its phases: ``pack`` (one flat buffer per bucket and its handle), ``load`` (the engines' answers
        to the bucket: they open the handle and copy into their weights; on CUDA the packing's device work
        finishes there too), ``session`` (the calls that open and close the engines' weight-update session)."""
        total = 0
        self.timings = {"pack": 0.0, "load": 0.0, "session": 0.0}
        opened = time.perf_counter()
        with self.client.weight_update_session():
            self.timings["session"] += time.perf_counter() - opened
            for bucket in buckets:
                begin = time.perf_counter()
                on_gpu = any(t.is_cuda for _, t in bucket)
                flat = flatten_tensors(bucket, self.for_sglang) if on_gpu else self._stage_on_cpu(bucket)
                payload = serialize_for_engine(flat, self.for_sglang)
                requests = [
                    {"serialized_named_tensors": [payload if on_gpu or index == 0 else
                                                  serialize_for_engine(flat, self.for_sglang)] * max(count, 1),
                     "load_format": "flattened_bucket", "flush_cache": False, "weight_version": weight_version}
                    for index, count in enumerate(self.engine_gpu_counts)  # a CPU engine counts 0 GPUs: one entry
                ]
                packed = time.perf_counter()
                self.client.post_all("/update_weights_from_tensor", requests)  # engines have copied when they answer
                self.timings["pack"] += packed - begin
                self.timings["load"] += time.perf_counter() - packed
                total += flat["flattened_tensor"].numel()
                del flat
            closing = time.perf_counter()
        self.timings["session"] += time.perf_counter() - closing
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return total

    def close(self) -> None:
        self._staging = None
        self.client.close()

"""Colocated transport: tensors handed to the engine by handle (``/update_weights_from_tensor``).

On CPU the bucket is one flattened uint8 tensor in shared memory (``file_system`` sharing, so an
unrelated engine process can map it); on GPU torch pickles CUDA-IPC handles. The buffer is kept
alive until every engine has answered, since the engine copies from it while handling the request.
"""

from __future__ import annotations

import torch

from slime.backends.embedded_engine.weight_loading import flatten_tensors, serialize_for_engine, use_file_system_sharing
from slime.backends.update_weight.base import EngineClient


class TensorWeightUpdater:
    def __init__(self, args, engine_urls: list[str], engine_gpu_counts: list[int]):
        self.args = args
        self.client = EngineClient(engine_urls)
        self.engine_gpu_counts = engine_gpu_counts
        use_file_system_sharing()

    def update(self, buckets, weight_version: str) -> int:
        """Send every bucket; return the number of bytes sent to each engine."""
        total = 0
        for bucket in buckets:
            flat = flatten_tensors(bucket)
            if not flat["flattened_tensor"].is_cuda:
                flat["flattened_tensor"].share_memory_()
            payload = serialize_for_engine(flat)
            requests = [
                {"serialized_named_tensors": [payload] * count, "load_format": "flattened_bucket",
                 "flush_cache": False, "weight_version": weight_version}
                for count in self.engine_gpu_counts
            ]
            self.client.post_all("/update_weights_from_tensor", requests)
            total += flat["flattened_tensor"].numel()
            del flat
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return total

    def close(self) -> None:
        self.client.close()

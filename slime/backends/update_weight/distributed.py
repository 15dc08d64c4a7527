"""Disaggregated transport: a broadcast group between trainer rank 0 and every engine rank.

``/init_weights_update_group`` once (rank 0 = trainer, engine *i* gets ranks
``1 + Σ_{j<i} gpus_j ...``), then per bucket ``/update_weights_from_distributed`` with the names,
dtypes and shapes, followed by one broadcast of the flattened bucket (``load_format
"flattened_bucket"``). The HTTP calls block on the collective, so they are fired first and awaited
after the broadcast. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from slime.backends.update_weight.wire_format import flatten_tensors, init_custom_process_group
from slime.backends.update_weight.engine_client import EngineClient

GROUP_NAME = "slime"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class DistributedWeightUpdater:
    def __init__(self, args, engine_urls: list[str], engine_gpu_counts: list[int], group_name: str = GROUP_NAME):
        self.args, self.group_name = args, group_name
        self.client = EngineClient(engine_urls)
        self.engine_gpu_counts = engine_gpu_counts
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.cpu_only else torch.device("cpu")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.group = None
        self._staging: torch.Tensor | None = None  # CPU: the send buffer, reused by every bucket (_flatten)

    def connect(self) -> None:
        host = "127.0.0.1" if all("127.0.0.1" in u or "localhost" in u for u in self.client.engine_urls) else socket.gethostbyname(socket.gethostname())
        port = _free_port(host)
        world_size = 1 + sum(self.engine_gpu_counts)
        offsets = [1 + sum(self.engine_gpu_counts[:i]) for i in range(len(self.engine_gpu_counts))]
        futures = [
            self.client._pool.submit(self.client.post, url, "/init_weights_update_group", {
                "master_address": host, "master_port": port, "rank_offset": offset, "world_size": world_size,
                "group_name": self.group_name, "backend": self.backend})
            for url, offset in zip(self.client.engine_urls, offsets)
        ]
        try:
            self.group = init_custom_process_group(self.backend, f"tcp://{host}:{port}", world_size, 0, self.group_name,
                                                   timeout=timedelta(minutes=self.args.distributed_timeout_minutes))
            for future in futures:
                future.result()
        except Exception as e:
            raise RuntimeError(
                f"could not form the weight-update process group between this trainer ({host}:{port}) and the "
                f"engines {self.client.engine_urls}: {e}. Engines that cannot reach the trainer (e.g. external "
                f"engines on another network) need --update-weight-transport disk --update-weight-disk-dir DIR on a "
                f"filesystem both sides see."
            ) from e

    def update(self, buckets, weight_version: str) -> int:
        """Send every bucket, one in flight at a time so the engines see them in order. Work overlaps
        the transfer where it can: the first bucket's request goes out before its tensors are
        flattened (the engines set up their receive meanwhile), and each next bucket is flattened
        while the engines receive and load the one in flight (on GPU the broadcast runs on NCCL's
        stream)."""
        if self.group is None:
            self.connect()
        with self.client.weight_update_session():
            return self._send(buckets, weight_version)

    def _send(self, buckets, weight_version: str) -> int:
        total = 0
        pending = None  # (futures, flat tensor) of the bucket in flight
        buckets = iter(buckets)
        bucket, flat = next(buckets, None), None
        while bucket is not None:
            payload = {
                "names": [name for name, _ in bucket],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name, "flush_cache": False, "weight_version": weight_version,
                "load_format": "flattened_bucket",
            }
            if pending is not None:
                self._wait(pending)
            futures = self.client.submit_all("/update_weights_from_distributed", payload)
            if flat is None:
                flat = self._flatten(bucket)
            dist.broadcast(flat, src=0, group=self.group)
            pending = (futures, flat)
            total += flat.numel()
            bucket = next(buckets, None)
            flat = self._flatten(bucket) if bucket is not None else None
        if pending is not None:
            self._wait(pending)
        return total

    def _flatten(self, bucket) -> torch.Tensor:
        """The bucket as one uint8 tensor in list order. On the CPU it is copied into one persistent
        buffer: a fresh ``torch.cat`` would page-fault through the whole bucket every update (a third of the
        tiny model's update time). gloo's broadcast has sent the buffer when it returns,
        so the next bucket may overwrite it; NCCL's runs on its stream, so GPU buckets stay fresh tensors."""
        if self.device.type != "cpu":
            return flatten_tensors([(name, t.to(self.device)) for name, t in bucket])["flattened_tensor"]
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        total = sum(sizes)
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8)
        offset = 0
        for (_, tensor), size in zip(bucket, sizes):
            self._staging[offset:offset + size].copy_(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
            offset += size
        return self._staging[:total]

    @staticmethod
    def _wait(pending) -> None:
        futures, _flat = pending  # the flat buffer stays referenced until the engines have answered
        for future in futures:
            future.result()

    def close(self) -> None:
        if self.group is not None:
            # Both sides tear the communicator down together: NCCL's destroy waits for the peers, so a
            # blocking request first (then the local destroy) would hang on GPU.
            futures = self.client.submit_all("/destroy_weights_update_group", {"group_name": self.group_name})
            dist.destroy_process_group(self.group)
            self.group = None
            self._staging = None
            for future in futures:
                try:
                    future.result(timeout=120)
                except Exception:  # engines may already be gone at shutdown
                    pass
        self.client.close()

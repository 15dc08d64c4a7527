"""One training rank as a Ray actor: sets up torch.distributed and hosts the training worker.

The worker (:class:`~slime.backends.training.worker.TrainWorker` over the ``--train-backend``
backend) holds the model; this actor adds what only the Ray layer knows: the process group, the
device, the object refs of the train data, and the weight transport to the engines.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import ray

logger = logging.getLogger(__name__)


@ray.remote
class TrainRayActor:
    def __init__(self, world_size: int, rank: int, master_addr: str | None, master_port: int | None):
        self.world_size, self.rank = world_size, rank
        self.master_addr, self.master_port = master_addr, master_port
        self.worker = None
        self.weight_updater = None

    def preload(self, train_backend: str) -> None:
        """Import the training stack (torch, the worker, the backend and what it imports: transformers
        or Megatron-Core) — seconds of a rank's start that need nothing else, so the job calls this
        while the engines are still starting. Touches no device."""
        from slime.backends.training.backend import backend_class
        from slime.backends.training.worker import TrainWorker  # noqa: F401

        backend_class(train_backend)

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def get_master_addr_and_port(self, timeout_minutes: float = 30.0) -> tuple[str, int]:
        """Rank 0: open the group's rendezvous store on a port the system picks and keep it bound, so no
        other process can take the port between its choice and :meth:`init` (a free port looked up
        and released first can be: two groups started together once got the same one, EADDRINUSE)."""
        from datetime import timedelta

        import torch.distributed as dist

        addr = ray.util.get_node_ip_address()
        addr = "127.0.0.1" if addr in ("127.0.0.1", "localhost") else addr
        self._store = dist.TCPStore(addr, 0, self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(minutes=timeout_minutes))
        return addr, self._store.port

    def init(self, args, role: str, master_addr: str, master_port: int) -> tuple[int | None, dict]:
        """Start this rank; returns (the rollout id to resume from or None, the data layout the
        backend declared, as a dict of :class:`~slime.backends.training.backend.DataLayout` fields)."""
        import dataclasses

        import torch
        import torch.distributed as dist

        from slime.backends.training.worker import TrainWorker
        from slime.ray.placement import use_gpu

        self.args, self.role = args, role
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        gpu = use_gpu(args)
        if gpu:
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, self.world_size)))
        backend = "cpu:gloo,cuda:nccl" if gpu else "gloo"  # CPU tensors (metrics) reduce over gloo
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        store = getattr(self, "_store", None)  # rank 0 holds the store it opened (get_master_addr_and_port)
        if store is None:
            store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self._store = None  # the process group keeps its own reference
        torch.manual_seed(args.seed)
        self.worker = TrainWorker(args, role=role)
        start = self.worker.init()
        return start, dataclasses.asdict(self.worker.layout)

    def set_runtime_args(self, runtime: dict) -> None:
        """Fields of args known only once the rollout side is up (router and engine addresses): a rank
        initialised while the engines started gets them here, as plugins run on it may read them."""
        for key, value in runtime.items():
            setattr(self.args, key, value)

    # ------------------------------------------------------------------ training

    @staticmethod
    def _resolve(batch_ref, extra_refs: list | None):
        # the driver passes [ref] so that Ray hands the ref over instead of resolving it in the caller;
        # extra_refs: refs of per-sample columns computed by other ranks (the critic's values, the
        # actor's log-probs), fetched here straight from the rank that produced them
        batch = ray.get(batch_ref[0]) if isinstance(batch_ref, list) else batch_ref
        for columns in ray.get(list(extra_refs)) if extra_refs else []:
            batch = batch.replace(**columns)
        return batch

    def train(self, rollout_id: int, batch_ref, extra_refs: list | None = None) -> dict:
        return self.worker.train(rollout_id, self._resolve(batch_ref, extra_refs))

    def compute_values(self, batch_ref) -> dict:
        return {"values": self.worker.compute_values(self._resolve(batch_ref, None))}

    def compute_log_probs(self, batch_ref) -> dict:
        return self.worker.compute_log_probs(self._resolve(batch_ref, None))

    def save(self, rollout_id: int) -> None:
        self.worker.save(rollout_id)

    def wait_for_save(self) -> None:
        if self.worker is not None:  # a rank the job never initialised (it failed before) has nothing in flight
            self.worker.wait_for_save()

    def save_hf(self, path: str) -> None:
        self.worker.save_hf(path)

    def offload(self) -> None:
        self.worker.offload()

    def begin_offload(self) -> None:
        self.worker.begin_offload()

    def onload(self) -> None:
        self.worker.onload()
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # device_memory() then reports this training phase's peak

    def release_cached_memory(self) -> None:
        """Return the device blocks the caching allocator keeps (a training step's activations) to the
        device, so another process on it (a colocated engine) can use them; live tensors stay."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def device_memory(self) -> dict | None:
        """This rank's device: total and used bytes (all processes on it) and this process's peak
        reserved bytes since the last onload; None without CUDA."""
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return {"total": total, "used": total - free, "peak_reserved": torch.cuda.max_memory_reserved()}

    # ------------------------------------------------------------------ weights to engines

    def connect_rollout_engines(self, engine_urls: list[str], engine_gpu_counts: list[int]) -> None:
        if self.rank != 0:
            return
        from slime.backends.update_weight import make_weight_updater

        if self.weight_updater is not None and hasattr(self.weight_updater, "set_engines"):
            self.weight_updater.set_engines(engine_urls)  # disk: keep the published chain (delta snapshot)
            return
        if self.weight_updater is not None:
            self.weight_updater.close()
        self.weight_updater = make_weight_updater(self.args, engine_urls, engine_gpu_counts, colocate=self.args.colocate)

    def update_weights(self, weight_version: int) -> dict:
        """Collective over the training ranks (buckets are gathered on all); rank 0 sends them."""
        start = time.perf_counter()
        buckets = self.worker.iter_weight_buckets(self.args.update_weight_buffer_size)
        if self.rank != 0:
            for _ in buckets:
                pass
            if self.args.update_weight_transport == "disk" and self.args.custom_update_weight_post_write_path:
                from slime.backends.update_weight.disk import run_post_write_hook

                # §2.20: the hook runs on every rank, after rank 0 wrote the files, before engines read them
                run_post_write_hook(self.args, None, list(self.args.rollout_engine_urls or []))
            return {}
        gather = [0.0]

        def timed(buckets):  # time spent producing each bucket: gathering the shards, casting to the engines' dtype
            iterator = iter(buckets)
            while True:
                begin = time.perf_counter()
                bucket = next(iterator, None)
                gather[0] += time.perf_counter() - begin
                if bucket is None:
                    return
                yield bucket

        paused = time.perf_counter()
        self.weight_updater.client.pause()
        admin = time.perf_counter() - paused
        try:
            sent = self.weight_updater.update(timed(buckets), str(weight_version))
        finally:
            resumed = time.perf_counter()
            self.weight_updater.client.resume()
            admin += time.perf_counter() - resumed
        seconds = time.perf_counter() - start
        # where the push went: the buckets' production, the engines' pause/flush/continue round trips, and the
        # transport's own phases (its `timings`: e.g. packing the bucket and the engines' copies)
        metrics = {"perf/update_weights_bytes": sent, "perf/update_weights_gbytes_per_s": sent / max(seconds, 1e-9) / 1e9,
                   "perf/update_weights_gather_time": gather[0], "perf/update_weights_admin_time": admin}
        for phase, value in getattr(self.weight_updater, "timings", {}).items():
            metrics[f"perf/update_weights_{phase}_time"] = value
        return metrics

    def push_weights_to(self, engine_urls: list[str], engine_gpu_counts: list[int], weight_version: int) -> int:
        """Send the current weights to just ``engine_urls`` (engines the health monitor restarted in the
        middle of a rollout, not yet back in the router) over a transport of their own, labelled
        ``weight_version``; the main transport is reconnected at the next ``update_weights``. Collective
        over the training ranks like ``update_weights``; returns the elements sent (rank 0)."""
        buckets = self.worker.iter_weight_buckets(self.args.update_weight_buffer_size)
        if self.rank != 0:
            for _ in buckets:
                pass
            return 0
        if self.args.colocate:
            from slime.backends.update_weight.tensor import TensorWeightUpdater

            updater = TensorWeightUpdater(self.args, engine_urls, engine_gpu_counts)
        else:
            from slime.backends.update_weight.distributed import DistributedWeightUpdater

            # a group name of its own: the main group (with the killed engine in it) still exists here
            updater = DistributedWeightUpdater(self.args, engine_urls, engine_gpu_counts, group_name="slime-restarted")
        try:
            updater.client.pause()
            try:
                return updater.update(buckets, str(weight_version))
            finally:
                updater.client.resume()
        finally:
            updater.close()

    def check_weights_equal(self, engine_url: str, names: list[str] | None = None) -> list[str]:
        """Compare engine weights with the trainer's (``--check-weight-update-equal``); returns mismatches."""
        import httpx
        import torch

        mismatches = []
        for bucket in self.worker.iter_weight_buckets(self.args.update_weight_buffer_size):
            if self.rank != 0:
                continue
            for name, tensor in bucket:
                if names is not None and name not in names:
                    continue
                response = httpx.post(f"{engine_url}/get_weights_by_name", json={"name": name, "truncate_size": 10**9}, timeout=60)
                response.raise_for_status()
                engine_values = torch.tensor(response.json(), dtype=torch.float32).flatten()
                mine = tensor.detach().float().cpu().flatten()[: engine_values.numel()]
                if not torch.allclose(mine, engine_values, atol=1e-2 if tensor.dtype == torch.bfloat16 else 1e-6):
                    mismatches.append(name)
        return mismatches

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.weight_updater is not None:
            self.weight_updater.close()
            self.weight_updater = None
        if dist.is_initialized():
            dist.destroy_process_group()

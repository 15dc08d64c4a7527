"""A group of training ranks (the actor, or the PPO critic) and the calls the loop makes on it.

The ranks declare their data layout at start (:class:`~slime.backends.training.backend.DataLayout`):
the rollout manager cuts each rollout step into ``dp_size`` shards and every rank of a data-parallel
replica receives the shard of its ``dp_rank``. Per-sample results one group hands to another (the
critic's values, the actor's log-probs) stay object refs: they travel rank to rank, not through the driver.
"""

from __future__ import annotations

import ray

from slime.backends.training.backend import DataLayout

from slime.ray.placement import Placement
from slime.ray.train_actor import TrainRayActor


class TrainGroup:
    def __init__(self, args, placement: Placement, role: str = "actor"):
        self.args, self.role = args, role
        world_size = len(placement.bundle_indices)
        if world_size == 0:
            raise ValueError(f"no devices for the {role}: set --actor-num-gpus-per-node (processes per node on CPU)")
        self.actors = []
        self.layouts: list[DataLayout] = []
        # colocated: each bundle also hosts an engine actor (0.1 CPU, 0.2 GPU), so leave room for it
        share = 0.8 if args.colocate else 1.0
        for rank in range(world_size):
            options = {"num_cpus": 0.5 if args.colocate else 1, "num_gpus": placement.gpus_per_bundle * share}
            strategy = placement.strategy(rank)
            if strategy is not None:
                options["scheduling_strategy"] = strategy
            self.actors.append(TrainRayActor.options(**options).remote(world_size, rank, None, None))
        # the ranks import the training stack now (the job creates the group before it waits for the
        # engines); init() waits for it, and a failed import is raised there
        self._preloaded = [actor.preload.remote(args.train_backend) for actor in self.actors]
        self._initialising: list | None = None  # refs of the ranks' init(), from start_init()

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def start_init(self) -> None:
        """Start initialising every rank (process group, device, models) with the args as they are now,
        without waiting for it; :meth:`init` waits."""
        try:
            addr, port = ray.get(self.actors[0].get_master_addr_and_port.remote(self.args.distributed_timeout_minutes),
                                 timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the {self.role} ranks could not be scheduled within 600 s: not enough free "
                               f"CPUs/GPUs in the placement group (see `ray status`)") from None
        self._initialising = [a.init.remote(self.args, self.role, addr, port) for a in self.actors]

    def init(self) -> int | None:
        """Initialise every rank (unless :meth:`start_init` began it) and record their layouts; return the
        rollout id to resume from (None = no checkpoint)."""
        if self._initialising is None:
            self.start_init()
        ray.get(self._preloaded)  # a failed import of the training stack is raised as itself
        results, self._initialising = ray.get(self._initialising), None
        self.layouts = [DataLayout(**layout) for _, layout in results]
        sizes = {layout.dp_size for layout in self.layouts}
        if len(sizes) != 1 or sorted({layout.dp_rank for layout in self.layouts}) != list(range(sizes.pop())):
            raise RuntimeError(f"the {self.role} ranks declared inconsistent data layouts: {self.layouts}")
        return results[0][0]

    @property
    def dp_size(self) -> int:
        """Data-parallel shards per rollout step (declared by the backend at init)."""
        return self.layouts[0].dp_size

    def _shard_of(self, rank: int, per_shard: list):
        return per_shard[self.layouts[rank].dp_rank]

    def _check_shards(self, data_refs: list) -> None:
        if len(data_refs) != self.dp_size:
            raise ValueError(f"the {self.role} has {self.dp_size} data-parallel shards but was given {len(data_refs)}")

    def train(self, rollout_id: int, data_refs: list, extras: list[list] | None = None) -> dict:
        """Train on per-shard data (one object ref per data-parallel shard, plus optional per-shard
        lists of refs of extra fields such as the critic's values); return rank 0's metrics (already
        reduced over ranks)."""
        self._check_shards(data_refs)
        calls = []
        for rank, actor in enumerate(self.actors):
            extra = self._shard_of(rank, extras) if extras else None
            calls.append(actor.train.remote(rollout_id, [self._shard_of(rank, data_refs)], extra))
        return ray.get(calls)[0]

    def async_train(self, rollout_id: int, data_refs: list) -> list:
        self._check_shards(data_refs)
        return [a.train.remote(rollout_id, [self._shard_of(rank, data_refs)]) for rank, a in enumerate(self.actors)]

    def _per_shard(self, method: str, data_refs: list) -> list:
        """Call ``method`` on every rank (it is collective); one result ref per data-parallel shard
        (every rank of a replica returns the same per-sample fields)."""
        self._check_shards(data_refs)
        refs = [getattr(a, method).remote([self._shard_of(rank, data_refs)]) for rank, a in enumerate(self.actors)]
        per_shard: list = [None] * self.dp_size
        for rank, ref in enumerate(refs):
            if per_shard[self.layouts[rank].dp_rank] is None:
                per_shard[self.layouts[rank].dp_rank] = ref
        return per_shard

    def compute_values(self, data_refs: list) -> list:
        """Critic: refs of ``{"values": [...]}``, one per shard, not fetched by the caller."""
        return self._per_shard("compute_values", data_refs)

    def compute_log_probs(self, data_refs: list) -> list:
        """Actor: refs of ``{"log_probs", "ref_log_probs", "kl", ...}``, one per shard."""
        return self._per_shard("compute_log_probs", data_refs)

    def save(self, rollout_id: int) -> None:
        ray.get([a.save.remote(rollout_id) for a in self.actors])

    def wait_for_save(self) -> None:
        """Block until a checkpoint written in the background (``--async-save``) is complete."""
        ray.get([a.wait_for_save.remote() for a in self.actors])

    def save_hf(self, path: str) -> None:
        ray.get([a.save_hf.remote(path) for a in self.actors])

    def offload(self) -> None:
        ray.get([a.offload.remote() for a in self.actors])

    def begin_offload(self) -> None:
        ray.get([a.begin_offload.remote() for a in self.actors])

    def onload(self) -> None:
        ray.get([a.onload.remote() for a in self.actors])

    def release_cached_memory(self) -> None:
        ray.get([a.release_cached_memory.remote() for a in self.actors])

    def device_memory(self) -> list[dict | None]:
        return ray.get([a.device_memory.remote() for a in self.actors])

    def set_runtime_args(self, runtime: dict) -> None:
        """Set what the rollout side learnt at start (router and engine addresses) on every rank's args."""
        ray.get([a.set_runtime_args.remote(runtime) for a in self.actors])

    def connect_rollout_engines(self, engine_urls: list[str], engine_gpu_counts: list[int]) -> None:
        ray.get([a.connect_rollout_engines.remote(engine_urls, engine_gpu_counts) for a in self.actors])

    def update_weights(self, weight_version: int) -> dict:
        return ray.get([a.update_weights.remote(weight_version) for a in self.actors])[0]

    def check_weights_equal(self, engine_url: str) -> list[str]:
        return ray.get([a.check_weights_equal.remote(engine_url) for a in self.actors])[0]

    def shutdown(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        except Exception:  # a dead rank must not block shutting down the rest
            pass
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        self.layouts: list[DataLayout] = []

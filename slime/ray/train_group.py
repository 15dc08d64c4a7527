"""A group of training ranks (the actor, or the PPO critic) and the calls the loop makes on it."""

from __future__ import annotations

import ray

from slime.ray.placement import Placement
from slime.ray.train_actor import TrainRayActor


class TrainGroup:
    def __init__(self, args, placement: Placement, role: str = "actor"):
        self.args, self.role = args, role
        world_size = len(placement.bundle_indices)
        if world_size == 0:
            raise ValueError(f"no devices for the {role}: set --actor-num-gpus-per-node (processes per node on CPU)")
        self.actors = []
        # colocated: each bundle also hosts an engine actor (0.1 CPU, 0.2 GPU), so leave room for it
        share = 0.8 if args.colocate else 1.0
        for rank in range(world_size):
            options = {"num_cpus": 0.5 if args.colocate else 1, "num_gpus": placement.gpus_per_bundle * share}
            strategy = placement.strategy(rank)
            if strategy is not None:
                options["scheduling_strategy"] = strategy
            self.actors.append(TrainRayActor.options(**options).remote(world_size, rank, None, None))

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def init(self) -> int | None:
        """Initialise every rank; return the rollout id to resume from (None = no checkpoint)."""
        try:
            addr, port = ray.get(self.actors[0].get_master_addr_and_port.remote(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the {self.role} ranks could not be scheduled within 600 s: not enough free "
                               f"CPUs/GPUs in the placement group (see `ray status`)") from None
        results = ray.get([a.init.remote(self.args, self.role, addr, port) for a in self.actors])
        return results[0]

    def train(self, rollout_id: int, data_refs: list, extras: list[dict] | None = None) -> dict:
        """Train on per-rank data (one object ref per rank, plus optional per-rank extra fields such as
        the critic's values); return rank 0's metrics (already reduced over ranks)."""
        extras = extras or [None] * len(self.actors)
        results = ray.get([a.train.remote(rollout_id, [ref], extra) for a, ref, extra in zip(self.actors, data_refs, extras)])
        return results[0]

    def async_train(self, rollout_id: int, data_refs: list) -> list:
        return [a.train.remote(rollout_id, [ref]) for a, ref in zip(self.actors, data_refs)]

    def compute_values(self, data_refs: list) -> list:
        return ray.get([a.compute_values.remote([ref]) for a, ref in zip(self.actors, data_refs)])

    def compute_log_probs(self, data_refs: list) -> list[dict]:
        return ray.get([a.compute_log_probs.remote([ref]) for a, ref in zip(self.actors, data_refs)])

    def save(self, rollout_id: int) -> None:
        ray.get([a.save.remote(rollout_id) for a in self.actors])

    def save_hf(self, path: str) -> None:
        ray.get([a.save_hf.remote(path) for a in self.actors])

    def offload(self) -> None:
        ray.get([a.offload.remote() for a in self.actors])

    def onload(self) -> None:
        ray.get([a.onload.remote() for a in self.actors])

    def device_memory(self) -> list[dict | None]:
        return ray.get([a.device_memory.remote() for a in self.actors])

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

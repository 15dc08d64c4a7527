"""Ray start-up and placement groups: GPUs where present, CPU bundles on a CPU machine.

On a CPU machine a "GPU" in the resource flags means one process: ``--actor-num-gpus-per-node 2``
starts two training ranks, ``--rollout-num-gpus 2`` two engines (each one bundle of logical CPUs).
Logical CPUs are over-provisioned (Ray's CPU count is a scheduling token, not a core) so the whole
loop fits on a 2-core laptop.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


def use_gpu(args) -> bool:
    import torch

    return torch.cuda.is_available() and not args.cpu_only


def init_ray(args) -> None:
    """Start (or attach to) Ray. Respects RAY_ADDRESS; otherwise starts a local instance."""
    if ray.is_initialized():
        return
    # plugins named by dotted path may live in the job's working directory (docs/INTERFACES.md §2.0)
    python_path = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "PYTHONPATH": python_path}
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        if name in os.environ:  # NVLink multicast stays off in every worker too
            env_vars[name] = os.environ[name]
    env_vars.update(args.train_env_vars or {})
    # under `ray job submit --runtime-env-json ...` Ray refuses to merge a driver env var that differs
    # from the job's: the job's own values (already in this process's environment) win
    job_env = _job_env_vars()
    env_vars = {k: v for k, v in env_vars.items() if k not in job_env}
    runtime_env = {"env_vars": env_vars}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        return
    num_cpus = None
    if not use_gpu(args):
        wanted = args.actor_num_nodes * args.actor_num_gpus_per_node * (2 if args.use_critic else 1)
        wanted += (args.rollout_num_gpus or 0) + 4
        num_cpus = max(wanted, os.cpu_count() or 1)
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env, log_to_driver=True,
             logging_level=logging.WARNING, configure_logging=True)


def _job_env_vars() -> dict:
    """The env vars of the Ray job this driver runs as (``ray job submit --runtime-env-json``), else {}."""
    import json

    config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")  # set by Ray's job manager
    return dict((config.get("runtime_env") or {}).get("env_vars") or {})


@dataclass
class Placement:
    """A placement group and the bundle indices (in device order) the actors use."""

    group: PlacementGroup | None
    bundle_indices: list[int]
    gpus_per_bundle: float

    def strategy(self, i: int):
        if self.group is None:
            return None
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=self.bundle_indices[i])


def _make_group(num_bundles: int, gpu: bool, name: str, num_nodes: int = 1) -> Placement:
    """``num_bundles`` devices; with ``num_nodes`` > 1, the same number on each of that many distinct
    nodes (one bundle per node, STRICT_SPREAD; device i on node i // per_node)."""
    if num_bundles == 0:
        return Placement(None, [], 0)
    if num_nodes > 1:
        if num_bundles % num_nodes:
            raise ValueError(f"{num_bundles} devices cannot be split evenly over {num_nodes} nodes")
        per_node = num_bundles // num_nodes
        bundles = [{"GPU": per_node, "CPU": per_node} if gpu else {"CPU": per_node} for _ in range(num_nodes)]
        group = placement_group(bundles, strategy="STRICT_SPREAD", name=name)
        _wait_ready(group, f"{name}: {num_nodes} nodes with {per_node} {'GPU' if gpu else 'CPU'}(s) each")
        return Placement(group, [i // per_node for i in range(num_bundles)], 1 if gpu else 0)
    bundles = [{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1} for _ in range(num_bundles)]
    group = placement_group(bundles, strategy="PACK", name=name)
    _wait_ready(group, f"{name}: {num_bundles} {'GPU' if gpu else 'CPU'} bundle(s)")
    return Placement(group, list(range(num_bundles)), 1 if gpu else 0)


def _wait_ready(group: PlacementGroup, what: str, timeout: float = 600) -> None:
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"placement group {what} could not be placed within {timeout:.0f} s: not enough free "
                           "resources on the cluster's nodes (see `ray status`)") from None


def create_placement_groups(args) -> dict[str, Placement]:
    """Actor (and critic) bundles; rollout bundles, shared with the actor's under --colocate."""
    gpu = use_gpu(args)
    actor_count = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.debug_rollout_only:
        actor_count = 0
    rollout_count = 0 if args.debug_train_only or args.rollout_external else (args.rollout_num_gpus or 0)
    if args.colocate:
        shared = _make_group(max(actor_count, rollout_count), gpu, "slime-colocated")
        return {"actor": shared, "critic": shared, "rollout": shared}
    # --actor-num-nodes > 1: the training ranks spread over that many nodes, --actor-num-gpus-per-node each
    nodes = args.actor_num_nodes if actor_count else 1
    actor = _make_group(actor_count, gpu, "slime-actor", nodes)
    critic = _make_group(actor_count, gpu, "slime-critic", nodes) if args.use_critic else Placement(None, [], 0)
    rollout = _make_group(rollout_count, gpu, "slime-rollout")
    return {"actor": actor, "critic": critic, "rollout": rollout}

"""Launch plans: the exact command line of every SGLang server process, computed before anything starts.

Pure functions of the flags, the engine layout (``sglang_config.ModelConfig``), where each rollout GPU
is (``device_map[i] = (node_ip, local_gpu_id)``) and a port allocator, so layouts can be checked
without a cluster. Rules (docs/SGLANG_PROTOCOL.md §9-10, docs/INTERFACES.md §4.2):

* Engines take consecutive rollout GPUs, models and groups in file order; a ``placeholder`` group
  takes its GPUs and starts nothing.
* An engine with at most ``--num-gpus-per-node`` GPUs lives on one node (it may not straddle two):
  ``--base-gpu-id`` is its first GPU there, ``--gpu-id-step 1``. A larger engine spans
  ``nnodes = gpus / gpus_per_node`` whole nodes: one process per node with ``--node-rank``, all
  rendezvousing at ``--dist-init-addr`` on the first node, which alone serves HTTP.
* ``--tp-size = gpus_per_engine / pp_size``; ``--dp-size``/``--ep-size``/``--pp-size`` and every
  other ``--sglang-*`` flag come from the pass-through, then the group's ``overrides`` win.
* Ports (HTTP, NCCL, a block of ``30 + dp_size`` for the distributed init, the prefill bootstrap
  port) are found free on the engine's first node and never handed out twice.
* Colocated with ``--offload-rollout``: ``--enable-memory-saver`` (and no prefill CUDA graphs
  unless the user chose a backend for them), so engines can release memory while the trainer runs.
* prefill engines: ``--disaggregation-mode prefill --disaggregation-bootstrap-port P
  --load-balance-method follow_bootstrap_room``; decode engines: ``--disaggregation-mode decode``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Callable

from slime.backends.sglang_utils.sglang_config import ModelConfig


@dataclass
class EngineProcess:
    """One ``sglang.launch_server`` process: one per node of an engine."""

    node_ip: str
    node_rank: int
    gpu_ids: list[int]  # local GPU indices on node_ip
    rollout_gpu_index: int  # index of its first GPU among the rollout GPUs (its placement bundle)
    server_args: dict  # ServerArgs field -> value, in command-line order
    argv: list[str]  # the full command line

    @property
    def base_gpu_id(self) -> int:
        return self.gpu_ids[0]


@dataclass
class EnginePlan:
    model: str
    group_index: int
    worker_type: str  # regular | prefill | decode
    update_weights: bool
    num_gpus: int
    host: str
    port: int
    processes: list[EngineProcess]
    bootstrap_port: int | None = None  # prefill engines

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def nnodes(self) -> int:
        return len(self.processes)

    def registration(self) -> dict:
        """The router's ``POST /workers`` body for this engine (docs/SGLANG_PROTOCOL.md §11.3)."""
        body = {"url": self.url, "worker_type": self.worker_type}
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        return body


@dataclass
class LaunchPlan:
    engines: list[EnginePlan] = field(default_factory=list)
    reserved_gpus: int = 0  # placeholder GPUs

    def for_model(self, name: str) -> list[EnginePlan]:
        return [e for e in self.engines if e.model == name]


class PortAllocator:
    """Hands out ports found free on each node, never the same one twice on a node.

    ``find_free(node_ip, start, count)`` returns the first port >= ``start`` beginning ``count``
    consecutive free ports on that node (on a cluster: asked of an actor on that node).
    """

    def __init__(self, find_free: Callable[[str, int, int], int], base_port: int = 15000):
        self.find_free = find_free
        self.base_port = base_port
        self.next_start: dict[str, int] = {}

    def take(self, node_ip: str, count: int = 1) -> int:
        port = self.find_free(node_ip, self.next_start.get(node_ip, self.base_port), count)
        self.next_start[node_ip] = port + count
        return port


def uniform_device_map(num_gpus: int, gpus_per_node: int, node_ips: list[str], first_gpu: int = 0) -> list[tuple[str, int]]:
    """Rollout GPU i -> (node, local id) when the rollout GPUs fill nodes in order from ``first_gpu``."""
    device_map = []
    for i in range(num_gpus):
        slot = first_gpu + i
        node = slot // gpus_per_node
        if node >= len(node_ips):
            raise ValueError(f"{num_gpus} rollout GPUs from GPU {first_gpu} need more than the {len(node_ips)} nodes given")
        device_map.append((node_ips[node], slot % gpus_per_node))
    return device_map


def _server_fields(args) -> tuple[int, dict]:
    """(pp_size, the user's pass-through fields) — pass-through keys are CLI names (``mem-fraction-static``)."""
    forwarded = {name.replace("-", "_"): value for name, value in (args.sglang_passthrough or {}).items()}
    pp = int(forwarded.get("pp_size") or forwarded.get("pipeline_parallel_size") or 1)
    return pp, forwarded


def plan_launch(args, models: list[ModelConfig], device_map: list[tuple[str, int]], ports: PortAllocator) -> LaunchPlan:
    gpus_per_node = args.num_gpus_per_node
    pp, forwarded = _server_fields(args)
    dp = int(forwarded.get("dp_size") or forwarded.get("data_parallel_size") or 1)
    needed = sum(m.num_gpus for m in models)
    if needed > len(device_map):
        raise ValueError(f"the engine layout needs {needed} GPUs but only {len(device_map)} rollout GPUs are placed "
                         f"(--rollout-num-gpus {args.rollout_num_gpus})")
    plan, cursor, rank = LaunchPlan(), 0, 0
    for model in models:
        for group_index, group in enumerate(model.server_groups):
            if group.worker_type == "placeholder":
                cursor += group.num_gpus
                plan.reserved_gpus += group.num_gpus
                continue
            n = group.num_gpus_per_engine
            if n % pp:
                raise ValueError(f"model {model.name!r} group {group_index}: {n} GPUs per engine is not divisible by "
                                 f"--sglang-pp-size {pp}")
            for _ in range(group.num_engines):
                gpus = device_map[cursor:cursor + n]
                plan.engines.append(_plan_engine(args, model, group_index, group, gpus, cursor, rank, pp, dp,
                                                 forwarded, ports, gpus_per_node))
                cursor += n
                rank += 1
    return plan


def _plan_engine(args, model, group_index, group, gpus, first_index, rank, pp, dp, forwarded, ports, gpus_per_node) -> EnginePlan:
    n = len(gpus)
    where = f"model {model.name!r} group {group_index} engine at rollout GPU {first_index}"
    if n > gpus_per_node:
        if n % gpus_per_node:
            raise ValueError(f"{where}: an engine spanning nodes needs a multiple of --num-gpus-per-node "
                             f"{gpus_per_node} GPUs, got {n}")
        nnodes = n // gpus_per_node
    else:
        nnodes = 1
    per_node = n // nnodes
    node_slices = [gpus[i * per_node:(i + 1) * per_node] for i in range(nnodes)]
    for node_gpus in node_slices:
        if len({ip for ip, _ in node_gpus}) != 1:
            raise ValueError(f"{where}: its GPUs {gpus} straddle nodes; choose GPUs per engine that divide "
                             f"--num-gpus-per-node {gpus_per_node}")
    if nnodes > 1 and len({s[0][0] for s in node_slices}) != nnodes:
        raise ValueError(f"{where}: a {nnodes}-node engine needs {nnodes} distinct nodes, got {[s[0][0] for s in node_slices]}")
    host = node_slices[0][0][0]
    http_port = ports.take(host)
    nccl_port = ports.take(host)
    dist_port = ports.take(host, 30 + dp)  # SGLang derives further ports from the init port (one per DP rank)
    bootstrap_port = ports.take(host) if group.worker_type == "prefill" else None
    processes = []
    for node_rank, node_gpus in enumerate(node_slices):
        fields = {
            "model_path": model.model_path,
            "host": host if node_rank == 0 else node_gpus[0][0],
            "port": http_port,
            "nccl_port": nccl_port,
            "tp_size": n // pp,
            "base_gpu_id": node_gpus[0][1],
            "gpu_id_step": 1,
            "nnodes": nnodes,
            "node_rank": node_rank,
            "dist_init_addr": f"{_bracket(host)}:{dist_port}",
            "random_seed": args.seed + rank * gpus_per_node,
            "trust_remote_code": True,
            "skip_server_warmup": True,
            "enable_metrics": True,
        }
        if args.use_rollout_routing_replay:
            fields["enable_return_routed_experts"] = True
        if args.fp16:
            fields["dtype"] = "float16"
        if args.colocate and args.offload_rollout and model.update_weights:
            fields["enable_memory_saver"] = True
            if "cuda_graph_backend_prefill" not in forwarded and "cuda_graph_backend_prefill" not in group.overrides:
                fields["cuda_graph_backend_prefill"] = "disabled"  # the memory saver cannot keep prefill graphs
        if group.worker_type == "prefill":
            fields.update(disaggregation_mode="prefill", disaggregation_bootstrap_port=bootstrap_port,
                          load_balance_method="follow_bootstrap_room")
        elif group.worker_type == "decode":
            fields["disaggregation_mode"] = "decode"
        merged = {**forwarded, **fields, **group.overrides}
        processes.append(EngineProcess(node_ip=node_gpus[0][0], node_rank=node_rank, gpu_ids=[g for _, g in node_gpus],
                                       rollout_gpu_index=first_index + node_rank * per_node, server_args=merged,
                                       argv=server_argv(merged)))
    return EnginePlan(model=model.name, group_index=group_index, worker_type=group.worker_type,
                      update_weights=model.update_weights, num_gpus=n, host=host, port=http_port,
                      processes=processes, bootstrap_port=bootstrap_port)


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip


def server_argv(fields: dict, python: str | None = None) -> list[str]:
    """``python -m sglang.launch_server`` plus ``--field-name value`` for each ServerArgs field.

    True -> the bare flag; False/None -> omitted (SGLang's default); lists -> several values;
    dicts -> JSON (SGLang's JSON-valued flags)."""
    argv = [python or sys.executable, "-m", "sglang.launch_server"]
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv

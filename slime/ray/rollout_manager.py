"""The rollout manager (a Ray actor): engines, router, data source, rollout and eval functions.

It turns a rollout step into per-rank training data: call the rollout function, dump it if asked,
compute rollout metrics, convert samples to the train-data dict and split it across data-parallel
ranks. Shutdown order: router first (no new requests reach engines), then engines.
"""

from __future__ import annotations

import logging
import time

import ray

from slime.rollout.base_types import call_rollout_fn
from slime.utils.misc import load_function

logger = logging.getLogger(__name__)


def _flatten(nested) -> list:
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(_flatten(item))
        else:
            out.append(item)
    return out


def check_fan_out(nested, depth: int = 0) -> None:
    """§1.8 item 4: an inner list at depth >= 2 with several samples must share one rollout_id."""
    if not isinstance(nested, list):
        return
    leaves = [x for x in nested if not isinstance(x, list)]
    if depth >= 2 and len(leaves) > 1:
        ids = {s.rollout_id for s in leaves}
        if None in ids or len(ids) != 1:
            raise AssertionError(f"a fan-out list must share one non-None rollout_id; found {sorted(map(str, ids))}")
    for item in nested:
        if isinstance(item, list):
            check_fan_out(item, depth + 1)


@ray.remote
class RolloutManager:
    def __init__(self, args, rollout_placement, dp_size: int):
        import slime.utils.http_utils as http_utils

        self.args, self.dp_size = args, dp_size
        self.engines, self.engine_urls, self.router = [], [], None
        if not args.debug_train_only:
            self._start_engines_and_router(rollout_placement)
        http_utils.init_http_client(args)
        self.data_source = load_function(args.data_source_path)(args)
        self.rollout_fn = load_function(args.rollout_function_path)
        self.eval_fn = load_function(args.eval_function_path)
        self.custom_log = load_function(args.custom_rollout_log_function_path) if args.custom_rollout_log_function_path else None
        self.custom_eval_log = (load_function(args.custom_eval_rollout_log_function_path)
                                if args.custom_eval_rollout_log_function_path else None)
        if args.num_rollout is None:
            per_epoch = len(self.data_source) // args.rollout_batch_size
            if per_epoch == 0:
                raise ValueError(f"--num-epoch: the dataset has {len(self.data_source)} prompts, fewer than "
                                 f"--rollout-batch-size {args.rollout_batch_size}")
            args.num_rollout = per_epoch * args.num_epoch

    # ------------------------------------------------------------------ engines and router

    def _start_engines_and_router(self, placement) -> None:
        from slime.ray.engine_actor import EngineActor

        args = self.args
        if args.rollout_external:
            self.engine_urls = [a if a.startswith("http") else f"http://{a}" for a in args.rollout_external_engine_addrs]
        else:
            per_engine = args.rollout_num_gpus_per_engine
            num_engines = (args.rollout_num_gpus or 0) // per_engine
            for i in range(num_engines):
                options = {"num_cpus": 0.1, "num_gpus": 0.2 if placement.gpus_per_bundle and args.colocate else placement.gpus_per_bundle}
                strategy = placement.strategy(i * per_engine)
                if strategy is not None:
                    options["scheduling_strategy"] = strategy
                self.engines.append(EngineActor.options(**options).remote(args, i, per_engine))
            self.engine_urls = ray.get([engine.start.remote() for engine in self.engines])
        args.rollout_engine_urls = list(self.engine_urls)
        args.rollout_num_engines = len(self.engine_urls)
        if args.sglang_router_ip is not None:
            self._register_with_external_router()
        else:
            from slime.backends.router import RouterProcess

            policy, extra = _router_argv(args)
            self.router = RouterProcess(policy=policy, worker_urls=self.engine_urls, extra_args=extra)
            self.router.start()
            self.router.wait_healthy(timeout=120)
            args.sglang_router_ip, args.sglang_router_port = self.router.host, self.router.port
        logger.info("engines %s behind router %s:%s", self.engine_urls, args.sglang_router_ip, args.sglang_router_port)

    def _register_with_external_router(self) -> None:
        import httpx

        base = f"http://{self.args.sglang_router_ip}:{self.args.sglang_router_port}"
        for url in self.engine_urls:
            response = httpx.post(f"{base}/workers", json={"url": url}, timeout=60)
            if response.status_code >= 400 and "WORKER_ALREADY_EXISTS" not in response.text:
                raise RuntimeError(f"registering engine {url} with the router at {base} failed: {response.text[:300]}")

    def get_runtime_args(self) -> dict:
        """What the driver must learn back: router address, engine URLs, derived num_rollout."""
        return {"sglang_router_ip": self.args.sglang_router_ip, "sglang_router_port": self.args.sglang_router_port,
                "rollout_engine_urls": self.engine_urls, "rollout_num_engines": len(self.engine_urls),
                "num_rollout": self.args.num_rollout}

    def engine_gpu_counts(self) -> list[int]:
        return [self.args.rollout_num_gpus_per_engine] * len(self.engine_urls)

    def check_engines(self) -> list[int]:
        """Restart dead engines (fault tolerance); return the indices that were restarted."""
        if not self.engines:
            return []
        alive = ray.get([engine.alive.remote() for engine in self.engines])
        restarted = []
        for i, ok in enumerate(alive):
            if not ok:
                logger.warning("engine %d (%s) is dead; restarting it", i, self.engine_urls[i])
                self.engine_urls[i] = ray.get(self.engines[i].restart.remote())
                restarted.append(i)
        if restarted and self.router is not None:
            for i in restarted:  # re-register: resets the router's health and circuit-breaker state
                try:
                    self.router.remove_worker(self.engine_urls[i])
                except KeyError:
                    pass
                self.router.add_worker(self.engine_urls[i])
        return restarted

    def kill_engine_for_test(self, index: int) -> None:
        ray.get(self.engines[index].kill_for_test.remote())

    def _post_engines(self, path: str, payload: dict | None = None) -> None:
        import httpx

        for url in self.engine_urls:
            httpx.post(url + path, json=payload or {}, timeout=300).raise_for_status()

    def offload(self) -> None:
        self._post_engines("/release_memory_occupation", {})

    def onload(self, tags: list[str] | None = None) -> None:
        self._post_engines("/resume_memory_occupation", {"tags": tags} if tags else {})

    # ------------------------------------------------------------------ a rollout step

    def generate(self, rollout_id: int) -> tuple[list, dict]:
        """Run one rollout step; return (one train-data object ref per DP rank, rollout metrics)."""
        from slime.rollout.sample_hooks import set_current_rollout_id
        from slime.utils.train_data import convert_samples_to_train_data, split_train_data_by_dp

        start = time.perf_counter()
        extra_metrics = None
        if self.args.load_debug_rollout_data:
            from slime.observability.rollout_data_utils import load_debug_rollout_data

            samples = load_debug_rollout_data(self.args.load_debug_rollout_data, rollout_id=rollout_id,
                                              subsample_ratio=self.args.load_debug_rollout_data_subsample)
        else:
            set_current_rollout_id(rollout_id)
            output = call_rollout_fn(self.rollout_fn, self.args, rollout_id, self.data_source, evaluation=False)
            check_fan_out(output.samples)
            samples, extra_metrics = _flatten(output.samples), output.metrics
        rollout_time = time.perf_counter() - start
        if self.args.save_debug_rollout_data:
            from slime.observability.rollout_data_utils import save_debug_rollout_data

            save_debug_rollout_data(self.args.save_debug_rollout_data, samples, rollout_id=rollout_id, evaluation=False)
        metrics = self._rollout_metrics(rollout_id, samples, extra_metrics, rollout_time)
        if self.args.debug_rollout_only:
            return [], metrics
        data = convert_samples_to_train_data(self.args, samples)
        shards = split_train_data_by_dp(self.args, data, self.dp_size)
        return [ray.put(shard) for shard in shards], metrics

    def _rollout_metrics(self, rollout_id, samples, extra_metrics, rollout_time) -> dict:
        if self.custom_log is not None and self.custom_log(rollout_id, self.args, samples, extra_metrics, rollout_time):
            return {}
        from slime.rollout.metrics import compute_rollout_metrics

        metrics = compute_rollout_metrics(self.args, samples, rollout_time)
        metrics.update(extra_metrics or {})
        return metrics

    def eval(self, rollout_id: int) -> dict:
        from slime.rollout.sample_hooks import set_current_rollout_id

        set_current_rollout_id(rollout_id)
        output = call_rollout_fn(self.eval_fn, self.args, rollout_id, self.data_source, evaluation=True)
        if self.args.save_debug_rollout_data:
            from slime.observability.rollout_data_utils import save_debug_rollout_data

            samples = [s for result in output.data.values() for s in result["samples"]]
            save_debug_rollout_data(self.args.save_debug_rollout_data, samples, rollout_id=rollout_id, evaluation=True)
        if self.custom_eval_log is not None and self.custom_eval_log(rollout_id, self.args, output.data, output.metrics):
            return {}
        from slime.rollout.metrics import compute_eval_metrics

        metrics = compute_eval_metrics(self.args, output.data)
        metrics.update(output.metrics or {})
        return metrics

    # ------------------------------------------------------------------ checkpoint of the data side

    def save(self, rollout_id: int) -> None:
        if self.args.rollout_global_dataset:
            self.data_source.save(rollout_id)

    def load(self, rollout_id: int | None) -> None:
        if self.args.rollout_global_dataset:
            self.data_source.load(rollout_id)

    def dispose(self) -> None:
        """Router first, so nothing new is routed to an engine that is going away; then engines."""
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.engines:
            ray.get([engine.stop.remote() for engine in self.engines], timeout=120)
            self.engines = []


def _router_argv(args) -> tuple[str, list[str]]:
    """The routing policy (the router's own default unless --router-policy) and the other --router-* flags."""
    forwarded = dict(getattr(args, "router_passthrough", {}) or {})
    policy = forwarded.pop("policy", "cache_aware")
    argv = []
    for name, value in forwarded.items():
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, list):
            argv += [f"--{name}", *map(str, value)]
        else:
            argv += [f"--{name}", str(value)]
    return policy, argv

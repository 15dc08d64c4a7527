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
    """Built in two calls: the constructor launches the engines and, while their servers start, builds
    the data side (data source, rollout and eval functions; ``num_rollout`` from the dataset under
    ``--num-epoch``); :meth:`start_serving` waits for the engines and puts the router in front of them."""

    def __init__(self, args, rollout_placement):
        self.args = args
        self.dp_size: int | None = None  # the trainer's data-parallel size, declared once its ranks are up
        self.engines, self.engine_urls, self.router = [], [], None
        self.engine_plans, self.routers, self.gpu_counts = [], {}, []
        self.health_monitor = None  # --use-fault-tolerance: probes the engines while a rollout runs
        self.weight_source, self.weight_version = None, None  # the actor's rank handles, the engines' version
        self.restarted_since_sync: set[int] = set()  # engines the next weight update must reconnect to
        self.awaiting_weights: set[int] = set()  # restarted, kept out of the router until they get weights
        self._health_restarts = 0  # engines the monitor restarted during the current rollout step
        self._engines_starting: list = []  # refs of the engine actors' start(), awaited by start_serving()
        if not args.debug_train_only:
            self._launch_engines(rollout_placement)
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

    def get_num_rollout(self) -> int:
        """Rollout steps of the run: ``--num-rollout``, or derived from the dataset's size and ``--num-epoch``."""
        return self.args.num_rollout

    def start_serving(self) -> dict:
        """Wait until the engines launched by the constructor answer their health checks, start (or join)
        the router in front of them and, with ``--use-fault-tolerance``, the health monitor; returns
        :meth:`get_runtime_args`."""
        import slime.utils.http_utils as http_utils
        from slime.rollout.sglang_rollout import get_num_engines

        if not self.args.debug_train_only:
            self._wait_for_engines_and_start_router()
            self._start_health_monitor()
        http_utils.init_http_client(self.args, get_num_engines(self.args))
        return self.get_runtime_args()

    # ------------------------------------------------------------------ engines and router

    def _launch_engines(self, placement) -> None:
        """Create the engine actors and ask each to start its server, without waiting for them."""
        args = self.args
        self.engine_plans = []  # launch_plan.EnginePlan per SGLang engine
        self.gpu_counts: list[int] = []
        self.routers = {}  # model name -> RouterProcess launched here
        if args.rollout_external:
            return  # described (over HTTP) in _wait_for_engines_and_start_router
        if args.rollout_backend == "sglang":
            self._launch_sglang(placement)
        else:
            self._launch_embedded(placement)

    def _wait_for_engines_and_start_router(self) -> None:
        args = self.args
        if args.rollout_external:
            from slime.backends.sglang_utils.external import describe_external_engines

            self.engine_urls, self.gpu_counts, layout = describe_external_engines(args.rollout_external_engine_addrs)
            args.rollout_num_gpus_per_engine = self.gpu_counts[0]
            logger.info("external engines %s (layout %s)", self.engine_urls, layout)
        else:
            urls = ray.get(self._engines_starting)
            self._engines_starting = []
            if self.engine_plans:  # SGLang: weights go to the trained model's engines; frozen models keep theirs
                updated = [e for e in self.engine_plans if e.update_weights]
                self.engine_urls, self.gpu_counts = [e.url for e in updated], [e.num_gpus for e in updated]
            else:
                per_engine = args.rollout_num_gpus_per_engine
                self.engine_urls, self.gpu_counts = urls, [per_engine] * len(urls)
        args.rollout_engine_urls = list(self.engine_urls)
        args.rollout_num_engines = len(self.engine_urls)
        self._start_or_join_routers()
        logger.info("engines %s behind router %s:%s", self.engine_urls, args.sglang_router_ip, args.sglang_router_port)

    def _launch_embedded(self, placement) -> None:
        from slime.ray.engine_actor import EngineActor

        args = self.args
        if args.sglang_config or args.prefill_num_servers:
            raise ValueError("--sglang-config and --prefill-num-servers describe SGLang servers: they need "
                             "--rollout-backend sglang")
        per_engine = args.rollout_num_gpus_per_engine
        num_engines = (args.rollout_num_gpus or 0) // per_engine
        for i in range(num_engines):
            options = {"num_cpus": 0.1, "num_gpus": 0.2 if placement.gpus_per_bundle and args.colocate else placement.gpus_per_bundle}
            strategy = placement.strategy(i * per_engine)
            if strategy is not None:
                options["scheduling_strategy"] = strategy
            self.engines.append([EngineActor.options(**options).remote(args, i, per_engine)])
        self._engines_starting = [engine[0].start.remote() for engine in self.engines]

    def _launch_sglang(self, placement) -> None:
        """Launch plan from the layout and where each rollout GPU is; one actor per engine process."""
        from slime.backends.sglang_utils.launch_plan import PortAllocator, plan_launch
        from slime.backends.sglang_utils.sglang_config import models_from_args
        from slime.ray.engine_actor import EngineActor, node_ip, probe_bundle, probe_free_port

        args = self.args
        models = models_from_args(args)
        num_gpus = sum(m.num_gpus for m in models)
        bundles = [placement.strategy(i) for i in range(num_gpus)]
        located = ray.get([probe_bundle.options(scheduling_strategy=b, num_gpus=0.01 if placement.gpus_per_bundle else 0).remote()
                           for b in bundles])
        single_node = len({ip for ip, _ in located}) == 1 and located[0][0] == node_ip()
        # one machine: serve on loopback (nothing exposed); several: each engine on its node's address
        device_map = [("127.0.0.1" if single_node else ip, gpus[0] if gpus else i % args.num_gpus_per_node)
                      for i, (ip, gpus) in enumerate(located)]
        first_bundle = {}
        for i, (ip, _) in enumerate(device_map):
            first_bundle.setdefault(ip, bundles[i])

        def find_free(ip: str, start: int, count: int) -> int:
            return ray.get(probe_free_port.options(scheduling_strategy=first_bundle[ip]).remote(start, count))

        plan = plan_launch(args, models, device_map, PortAllocator(find_free))
        for index, engine in enumerate(plan.engines):
            actors = []
            for process in engine.processes:
                options = {"num_cpus": 0.1, "num_gpus": 0.2 if placement.gpus_per_bundle else 0,
                           "scheduling_strategy": bundles[process.rollout_gpu_index]}
                actors.append(EngineActor.options(**options).remote(args, index, engine.num_gpus, process))
            self.engines.append(actors)
        self.engine_plans = plan.engines
        self._engines_starting = [a.start.remote(1800.0) for actors in self.engines for a in actors]

    def _start_or_join_routers(self) -> None:
        """A router per model (or the external one for the trained model); fills the router addresses."""
        from slime.backends.sglang_utils.router_launch import launch_router, register_workers

        args = self.args
        by_model: dict[str, list] = {}
        for engine in self.engine_plans:
            by_model.setdefault(engine.model, []).append(engine)
        default_model = next((e.model for e in self.engine_plans if e.update_weights), None)
        external_router = args.sglang_router_ip is not None
        if external_router:
            base = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
            bodies = ([e.registration() for e in by_model.get(default_model, [])] if self.engine_plans
                      else [{"url": url, "worker_type": "regular"} for url in self.engine_urls])
            register_workers(base, bodies)
        elif not self.engine_plans:  # embedded or external engines: one router in front of them
            from slime.backends.router import RouterProcess
            from slime.backends.sglang_utils.router_launch import router_argv

            policy, extra = router_argv(args)
            self.router = RouterProcess(policy=policy, worker_urls=self.engine_urls, extra_args=extra)
            self.router.start()
            self.router.wait_healthy(timeout=120)
            args.sglang_router_ip, args.sglang_router_port = self.router.host, self.router.port
        routers = {}
        for name, engines in by_model.items():
            if external_router and name == default_model:
                routers[name] = (args.sglang_router_ip, args.sglang_router_port)
                continue
            host = "127.0.0.1" if all(e.host == "127.0.0.1" for e in engines) else _node_address()
            self.routers[name] = launch_router(args, engines, host=host)
            routers[name] = (self.routers[name].host, self.routers[name].port)
        if routers:
            args.sglang_model_routers = routers
            if not external_router:
                args.sglang_router_ip, args.sglang_router_port = routers[default_model or next(iter(routers))]
                self.router = self.routers.get(default_model)

    def get_runtime_args(self) -> dict:
        """What the driver must learn back: router addresses, engine URLs, derived num_rollout."""
        return {"sglang_router_ip": self.args.sglang_router_ip, "sglang_router_port": self.args.sglang_router_port,
                "sglang_model_routers": self.args.sglang_model_routers,
                "rollout_engine_urls": self.engine_urls, "rollout_num_engines": len(self.engine_urls),
                "rollout_num_gpus_per_engine": self.args.rollout_num_gpus_per_engine,
                "num_rollout": self.args.num_rollout}

    def engine_gpu_counts(self) -> list[int]:
        """GPUs of each engine whose weights are updated (the ranks of the weight-update group)."""
        return list(self.gpu_counts)

    # ------------------------------------------------------------------ fault tolerance

    def _start_health_monitor(self) -> None:
        from slime.ray.engine_health import EngineHealthMonitor

        args = self.args
        if not args.use_fault_tolerance or not self.engines:  # external engines are not ours to restart
            return
        self.health_monitor = EngineHealthMonitor(
            self._probe_urls, self._recover, interval=args.rollout_health_check_interval,
            timeout=args.rollout_health_check_timeout, first_wait=args.rollout_health_check_first_wait)
        for index in range(len(self._probe_urls())):
            self.health_monitor.mark_up(index)

    def _own_routers(self) -> list:
        """The routers launched here (an external router is not ours to restart)."""
        return list({id(r): r for r in [self.router, *self.routers.values()] if r is not None}.values())

    def _probe_urls(self) -> list[str]:
        """What the health monitor probes: every engine (index = engine index), then every router of ours."""
        from slime.ray.engine_health import ENGINE_PROBE_PATH, ROUTER_PROBE_PATH

        engines = [self._engine_url(i) + ENGINE_PROBE_PATH for i in range(len(self.engines))]
        return engines + [router.url + ROUTER_PROBE_PATH for router in self._own_routers()]

    def _recover(self, index: int, reason: str) -> None:
        if index < len(self.engines):
            self._recover_engine(index, reason)
        else:
            self._recover_router(self._own_routers()[index - len(self.engines)], reason)

    def _recover_router(self, router, reason: str) -> None:
        """A router that failed its probe is restarted on its port with the engines it was launched
        with; the rollout's HTTP client retries the requests that failed meanwhile (the engines may
        have answered a lost request already: its sample gets the answer of the retry, once)."""
        router.restart(timeout=120)
        for index in self.awaiting_weights:  # restarted engines still waiting for their weights stay out
            self._unregister(index)
        logger.warning("router at %s restarted after: %s", router.url, reason)

    def _engine_url(self, index: int) -> str:
        return self.engine_plans[index].url if self.engine_plans else self.engine_urls[index]

    def _weight_index(self, index: int) -> int | None:
        """Position of engine ``index`` among the engines whose weights are updated (None: a frozen model)."""
        if not self.engine_plans:
            return index
        updated = [i for i, e in enumerate(self.engine_plans) if e.update_weights]
        return updated.index(index) if index in updated else None

    def set_weight_source(self, train_actors: list) -> None:
        """The actor's rank handles: the health monitor asks them for the current weights of an engine it
        restarted mid-rollout (they are idle then in the synchronous loop)."""
        self.weight_source = list(train_actors)

    def weights_synced(self, weight_version: int) -> None:
        """Every engine now serves ``weight_version``; the next update needs no reconnect."""
        self.weight_version = weight_version

    def _can_push_weights_now(self) -> bool:
        """Only when the trainer's weights are the engines' (the synchronous loop: the trainer waits for
        the rollout) and a broadcast or tensor transport can reach one engine on its own."""
        args = self.args
        return (self.weight_source is not None and self.weight_version is not None
                and not args.rollout_overlaps_training and args.update_weight_transport != "disk")

    def _recover_engine(self, index: int, reason: str) -> None:
        """The health monitor's answer to an engine that failed its probe: out of the router (the
        requests that failed on it are retried by the rollout's HTTP client on the others), killed,
        restarted on its devices and port, given the current weights, back in the router."""
        url = self._engine_url(index)
        self._unregister(index)
        ray.get([actor.kill.remote() for actor in self.engines[index]])
        urls = ray.get([actor.start.remote(1800.0) for actor in self.engines[index]])
        if not self.engine_plans:
            self.engine_urls[index] = urls[0]
        weight_index = self._weight_index(index)
        if weight_index is None:  # a frozen model keeps the weights it loads
            self._reregister([index])
            return
        self.restarted_since_sync.add(index)
        if self.weight_source is None or self.weight_version is None:  # no trainer, or before the first sync
            self._reregister([index])
        elif self._can_push_weights_now():
            gpus = self.gpu_counts[weight_index]
            ray.get([a.push_weights_to.remote([url], [gpus], self.weight_version) for a in self.weight_source])
            served = _served_weight_version(url)
            if served != str(self.weight_version):
                raise RuntimeError(f"engine {index} at {url} was restarted and sent weight version "
                                   f"{self.weight_version}, but serves version {served!r}")
            self._reregister([index])
        else:  # train_async.py or disk transport: it rejoins at the next weight update (check_engines)
            self.awaiting_weights.add(index)
        logger.warning("engine %d at %s restarted after: %s (weights: %s)", index, url, reason,
                       "waiting for the next update" if index in self.awaiting_weights else f"version {self.weight_version}")

    def _unregister(self, index: int) -> None:
        """Take an engine out of its router so nothing new (nor a retry) is sent to it."""
        url = self._engine_url(index)
        router = self.routers.get(self.engine_plans[index].model) if self.engine_plans else self.router
        if router is None:  # an external router: its own health checks take the worker out
            return
        try:
            router.remove_worker(url)
        except KeyError:
            pass

    def _monitored(self, fn):
        """Run ``fn()`` with the health monitor probing the engines; it stops (finishing any recovery) after."""
        if self.health_monitor is None:
            return fn()
        before = len(self.health_monitor.recovered)
        self.health_monitor.start()
        try:
            result = fn()
        finally:
            self.health_monitor.stop()
        self._health_restarts = len(self.health_monitor.recovered) - before
        return result

    def check_engines(self) -> list[int]:
        """Restart dead engines (fault tolerance); return the indices restarted since the last weight
        update, by this check or by the health monitor. The caller then reconnects the weight transport
        and pushes the current weights to every engine (``Job.update_weights``)."""
        if not self.engines:
            return []
        alive = [ray.get([a.alive.remote() for a in actors]) for actors in self.engines]
        restarted = []
        for i, flags in enumerate(alive):
            if all(flags):
                continue
            logger.warning("engine %d is dead (processes alive: %s); restarting it", i, flags)
            for actor in self.engines[i]:
                ray.get(actor.stop.remote())
            urls = ray.get([a.start.remote(1800.0) for a in self.engines[i]])
            restarted.append(i)
            if i < len(self.engine_urls) and not self.engine_plans:
                self.engine_urls[i] = urls[0]
        if restarted:
            self._reregister(restarted)
        waiting = sorted(self.awaiting_weights - set(restarted))
        if waiting:  # restarted mid-rollout; the weights they need come with this update
            self._reregister(waiting)
        self.awaiting_weights.clear()
        restarted = sorted(set(restarted) | self.restarted_since_sync)
        self.restarted_since_sync.clear()
        return restarted

    def _reregister(self, restarted: list[int]) -> None:
        """Re-register restarted engines: resets the router's health and circuit-breaker state."""
        from slime.backends.sglang_utils.router_launch import register_workers

        for i in restarted:
            if self.engine_plans:
                engine = self.engine_plans[i]
                router = self.routers.get(engine.model)
                body = engine.registration()
            else:
                router, body = self.router, {"url": self.engine_urls[i]}
            if router is None:
                register_workers(f"http://{self.args.sglang_router_ip}:{self.args.sglang_router_port}", [body])
                continue
            try:
                router.remove_worker(body["url"])
            except KeyError:
                pass
            router.add_worker(**body)

    def kill_engine_for_test(self, index: int) -> None:
        ray.get(self.engines[index][0].kill_for_test.remote())

    def _post_engines(self, path: str, payload: dict | None = None) -> None:
        from slime.utils.http_utils import sync_client

        for url in self.engine_urls:
            sync_client().post(url + path, json=payload or {}, timeout=300).raise_for_status()

    def offload(self) -> None:
        self._post_engines("/release_memory_occupation", {})

    def onload(self, tags: list[str] | None = None) -> None:
        self._post_engines("/resume_memory_occupation", {"tags": tags} if tags else {})

    # ------------------------------------------------------------------ a rollout step

    def set_data_parallel_size(self, dp_size: int) -> None:
        """The trainer's declared data-parallel size: each rollout step is cut into this many shards."""
        if dp_size < 1:
            raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
        self.dp_size = dp_size

    def generate(self, rollout_id: int) -> tuple[list, dict]:
        """Run one rollout step; return (one train-data object ref per data-parallel shard, rollout metrics)."""
        from slime.rollout.sample_hooks import set_current_rollout_id
        from slime.backends.training.train_data import convert_samples_to_train_data, split_train_data_by_dp

        start = time.perf_counter()
        extra_metrics = None
        if self.args.load_debug_rollout_data:
            from slime.observability.rollout_data_utils import load_debug_rollout_data

            samples = load_debug_rollout_data(self.args.load_debug_rollout_data, rollout_id=rollout_id,
                                              subsample_ratio=self.args.load_debug_rollout_data_subsample)
        else:
            from slime.observability.profiling import profile_rollout
            from slime.rollout.engine_control import engine_counters, engine_time_metrics

            set_current_rollout_id(rollout_id)
            counters = engine_counters(self.engine_urls) if self.engine_urls else None
            self._health_restarts = 0
            with profile_rollout(self.args, rollout_id, self.engine_urls):
                output = self._monitored(lambda: call_rollout_fn(self.rollout_fn, self.args, rollout_id,
                                                                 self.data_source, evaluation=False))
            check_fan_out(output.samples)
            samples, extra_metrics = _flatten(output.samples), output.metrics
            if self.health_monitor is not None:
                extra_metrics = {**(extra_metrics or {}), "perf/engine_health_restarts": self._health_restarts}
            if counters is not None and not self._health_restarts:  # a restarted engine's counters start at 0
                engine_metrics = engine_time_metrics(counters, engine_counters(self.engine_urls),
                                                     time.perf_counter() - start, len(self.engine_urls))
                extra_metrics = {**(extra_metrics or {}), **engine_metrics}
        rollout_time = time.perf_counter() - start
        if self.args.save_debug_rollout_data:
            from slime.observability.rollout_data_utils import save_debug_rollout_data

            save_debug_rollout_data(self.args.save_debug_rollout_data, samples, rollout_id=rollout_id, evaluation=False)
        metrics = self._rollout_metrics(rollout_id, samples, extra_metrics, rollout_time)
        if not self.args.load_debug_rollout_data:
            from slime.rollout.step_checks import check_step_can_learn

            check_step_can_learn(self.args, samples, rollout_id)  # after the dump: a failed step can be inspected
        if self.args.debug_rollout_only:
            return [], metrics
        if self.dp_size is None:
            raise RuntimeError("generate() for training before the trainer declared its data-parallel size "
                               "(set_data_parallel_size)")
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
        output = self._monitored(lambda: call_rollout_fn(self.eval_fn, self.args, rollout_id, self.data_source,
                                                         evaluation=True))
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
        if self.health_monitor is not None:
            self.health_monitor.stop()
        for router in {id(r): r for r in [self.router, *getattr(self, "routers", {}).values()] if r is not None}.values():
            router.stop()
        self.router, self.routers = None, {}
        if self.engines:
            ray.get([actor.stop.remote() for actors in self.engines for actor in actors], timeout=120)
            self.engines = []


def _served_weight_version(url: str) -> str | None:
    from slime.utils.http_utils import sync_client

    return sync_client().get(f"{url}/get_weight_version", timeout=30).json().get("weight_version")


def _node_address() -> str:
    return ray.util.get_node_ip_address()

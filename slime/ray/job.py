"""What ``train.py`` and ``train_async.py`` share: start-up, the named steps of the loop, shutdown.

Start-up order (INTERFACES Appendix B): Ray → placement groups → rollout manager (engines, router,
data source) → trainers (checkpoint load decides the first rollout id) → data-source state → first
weight sync. What does not depend on each other overlaps: the data source is built while the engines
start, and trainers with devices of their own initialise meanwhile (colocated ones after the engines
are up and offloaded). Shutdown order: trainers, then the rollout manager (router, then engines), then Ray —
also after a crash or Ctrl-C (``with Job(args) as job:``).
"""

from __future__ import annotations

import logging
import os
import time

import ray

from slime.ray.placement import create_placement_groups, init_ray
from slime.ray.rollout_manager import RolloutManager
from slime.ray.train_group import TrainGroup
from slime.utils.misc import load_function
from slime.utils.tracking import Tracker

logger = logging.getLogger(__name__)


def _raise_on_sigterm() -> None:
    """Turn SIGTERM (schedulers, `kill`) into SystemExit so the shutdown order still runs."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


class Job:
    def __init__(self, args):
        self.args = args
        self.actor = self.critic = self.rollout_manager = None
        self.tracker = Tracker(args)
        args.run_dir = os.path.abspath(self.tracker.run_dir)  # trainers and engines write profiles there too
        self.timings: dict[str, float] = {}
        self.weight_version = 0
        self._engine_memory = None  # device memory with the engines resident, for the offload decision
        self.owns_ray = False  # a Ray instance started by someone else (tests, notebooks) is left running

    # ------------------------------------------------------------------ start-up

    def __enter__(self) -> "Job":
        try:
            self._start()
        except BaseException:
            self.shutdown(dispose_timeout=self.INTERRUPTED_DISPOSE_S)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # interrupted (SIGTERM, Ctrl-C, an error): the rollout manager may be busy in a hook that never
        # returns, so it gets seconds, not minutes, to stop its engines before it is killed
        self.shutdown(dispose_timeout=self.INTERRUPTED_DISPOSE_S if exc_type is not None else 180)

    #: seconds an interrupted run waits for the rollout side to stop cleanly (engines die with it anyway)
    INTERRUPTED_DISPOSE_S = 5

    def _start(self) -> None:
        from slime.preflight import preflight

        args = self.args
        preflight(args)  # hooks, reward, data files, --save: before Ray or any engine starts
        if not os.path.isdir(args.hf_checkpoint or ""):
            raise FileNotFoundError(f"--hf-checkpoint {args.hf_checkpoint!r} is not a directory")
        if getattr(load_function(args.rollout_function_path), "overlaps_training", False):
            args.rollout_overlaps_training = True  # e.g. the fully async rollout: CPU engines leave cores to trainers
        self.owns_ray = not ray.is_initialized()
        init_ray(args)
        _raise_on_sigterm()  # after ray.init, which installs a handler of its own
        self.placements = create_placement_groups(args)
        start_rollout_id = self._start_rollout_side_and_trainers()
        if args.start_rollout_id is None:
            args.start_rollout_id = start_rollout_id or 0
        if args.start_rollout_id > 0:
            ray.get(self.rollout_manager.load.remote(args.start_rollout_id - 1))
        # weight_version == number of rollout steps trained on: the first sync publishes start_rollout_id
        self.weight_version = args.start_rollout_id - 1
        self._log_placement()
        if self.actor is not None and not args.debug_train_only:
            engine_gpu_counts = ray.get(self.rollout_manager.engine_gpu_counts.remote())
            self.actor.connect_rollout_engines(args.rollout_engine_urls, engine_gpu_counts)
            self.update_weights()
            if args.check_weight_update_equal:
                mismatches = self.actor.check_weights_equal(args.rollout_engine_urls[0])
                if mismatches:
                    raise RuntimeError(f"--check-weight-update-equal: engine weights differ for {mismatches[:10]}")
                logger.info("--check-weight-update-equal: engine weights equal the trainer's")

    def _start_rollout_side_and_trainers(self) -> int | None:
        """The rollout manager (engines, router, data source) and the trainer groups, initialised;
        returns the rollout id a checkpoint resumes from (None = none)."""
        args, placements = self.args, self.placements
        # the manager launches the engines and builds the data side while their servers start
        self.rollout_manager = RolloutManager.options(num_cpus=1).remote(args, placements["rollout"])
        trainers = []
        if not args.debug_rollout_only:
            # the trainer processes start and import the training stack while the engines start
            self.actor = TrainGroup(args, placements["actor"], role="actor")
            trainers.append(self.actor)
            if args.use_critic:
                self.critic = TrainGroup(args, placements["critic"], role="critic")
                trainers.append(self.critic)
        # trainers on devices of their own are initialised (devices, models) while the engines start;
        # colocated ones once the engines are up and have released the devices they share
        early = bool(trainers) and not args.colocate and not args.offload_rollout
        # their LR schedule spans the run: under --num-epoch its length comes from the dataset's size
        num_rollout = self.rollout_manager.get_num_rollout.remote() if early and args.num_rollout is None else None
        serving = self.rollout_manager.start_serving.remote()
        if early:
            if num_rollout is not None:
                args.num_rollout = ray.get(num_rollout)
            for group in trainers:
                group.start_init()
        runtime = ray.get(serving)
        for key, value in runtime.items():
            setattr(args, key, value)
        if args.offload_rollout and not args.debug_train_only:
            ray.get(self.rollout_manager.offload.remote())
        if not trainers:
            return None
        start_rollout_id = self.actor.init()
        if self.critic is not None:
            self.critic.init()
            if self.critic.dp_size != self.actor.dp_size:
                raise ValueError(f"the critic has {self.critic.dp_size} data-parallel shards and the actor "
                                 f"{self.actor.dp_size}: PPO hands values shard by shard, so give both the same "
                                 "data-parallel size (the critic shares the actor's GPUs: keep TP × PP × CP of the "
                                 "--megatron-config-path critic: section equal to the actor's)")
        for group in trainers:
            group.set_runtime_args(runtime)  # router and engine addresses, as the driver's args have them
        ray.get(self.rollout_manager.set_data_parallel_size.remote(self.actor.dp_size))
        if args.use_fault_tolerance:  # an engine restarted mid-rollout gets the current weights from them
            ray.get(self.rollout_manager.set_weight_source.remote(self.actor.actors))
        return start_rollout_id

    def _log_placement(self) -> None:
        """Which node each training rank and engine runs on (one line; multi-node runs are read from it)."""
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        ranks = ray.get([a.node_ip.remote() for a in self.actor.actors]) if self.actor is not None else []
        logger.info("placement on %d Ray node(s): actor ranks on %s; engines at %s", len(nodes), ranks,
                    list(self.args.rollout_engine_urls or []))

    # ------------------------------------------------------------------ the loop's named steps

    def _timed(self, name: str, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.timings[name] = time.perf_counter() - start
        return result

    def generate(self, rollout_id: int):
        data_refs, metrics = self._timed("rollout", lambda: ray.get(self.rollout_manager.generate.remote(rollout_id)))
        self.tracker.log(metrics, rollout_id, "rollout")
        return data_refs, metrics

    def train(self, rollout_id: int, data_refs: list) -> dict:
        if self.actor is None:
            return {}
        if self.args.offload_rollout:
            if self._auto_offload_pending():
                self._engine_memory = self.actor.device_memory()  # engines resident, trainer offloaded
            self._timed("offload_rollout", lambda: ray.get(self.rollout_manager.offload.remote()))
        if self.args.offload_train:
            self._timed("onload_train", self.actor.onload)
        start = time.perf_counter()
        metrics, extras = {}, None
        if self.critic is not None:
            # PPO: V_old from the critic (and π_old from the actor when KL shapes the reward) are
            # computed once, then both sides train on the same values and advantages; the results
            # stay object refs, fetched by the ranks that use them
            extras = [[values] for values in self.critic.compute_values(data_refs)]
            if self.args.kl_coef != 0:
                for extra, log_probs in zip(extras, self.actor.compute_log_probs(data_refs)):
                    extra.append(log_probs)
            metrics.update(self.critic.train(rollout_id, data_refs, extras))
        if self.critic is None or rollout_id >= self.args.num_critic_only_steps:
            metrics.update(self.actor.train(rollout_id, data_refs, extras))
        self.timings["train"] = time.perf_counter() - start
        self.tracker.log(metrics, rollout_id, "train")
        return metrics

    def save(self, rollout_id: int) -> None:
        if self.actor is not None:
            self.actor.save(rollout_id)
            if self.critic is not None:
                self.critic.save(rollout_id)
            if self.args.save_hf:
                self.actor.save_hf(self.args.save_hf.format(rollout_id=rollout_id))
        ray.get(self.rollout_manager.save.remote(rollout_id))

    def update_weights(self) -> dict:
        if self.actor is None or self.args.debug_train_only:
            return {}
        start = time.perf_counter()
        restarted = []
        if self.args.use_fault_tolerance:
            restarted = ray.get(self.rollout_manager.check_engines.remote())
            if restarted:
                urls = ray.get(self.rollout_manager.get_runtime_args.remote())["rollout_engine_urls"]
                self.args.rollout_engine_urls = urls
                self.actor.connect_rollout_engines(urls, ray.get(self.rollout_manager.engine_gpu_counts.remote()))
        keep_resident = self._auto_offload_pending() and self._fits_without_offload()
        offload_train = self.args.offload_train and not keep_resident
        # The engines' weights come back beside the trainer's, which go out only after they are sent: the
        # push is then device to device (CUDA IPC) rather than through host memory. The trainer's live
        # tensors (fp32 parameters and Adam state, 12 bytes a parameter) hold 6x the engines' bf16 weights, so this fits
        # wherever training did, once the trainer has returned the blocks its activations left cached.
        if offload_train and self.args.offload_rollout:
            self._timed("release_train_cache", self.actor.release_cached_memory)
        if offload_train:
            # the optimizer state goes to the host (device to host) while the engines bring their weights back (host
            # to device: the two directions at once) and the weights are pushed; its device memory is freed after
            self._timed("begin_offload_train", self.actor.begin_offload)
        if self.args.offload_rollout:
            self._timed("onload_rollout_weights", lambda: ray.get(self.rollout_manager.onload.remote(["weights"])))
        self.weight_version += 1
        try:
            metrics = self.actor.update_weights(self.weight_version)
        except Exception as e:  # without fault tolerance a dead engine ends the run: say so, with the flag
            if not self.args.use_fault_tolerance and not self.args.rollout_external:
                from slime.rollout.engine_control import raise_if_engines_dead_sync

                raise_if_engines_dead_sync(list(self.args.rollout_engine_urls or []), e)
            raise
        if offload_train:
            self._timed("offload_train", self.actor.offload)
        if self.args.use_fault_tolerance:
            metrics["perf/engines_restarted"] = len(restarted)
            ray.get(self.rollout_manager.weights_synced.remote(self.weight_version))
        if self.args.offload_rollout:
            self._timed("onload_rollout_kv", lambda: ray.get(self.rollout_manager.onload.remote(["kv_cache"])))
        if keep_resident:
            self.args.offload_train = self.args.offload_rollout = False
        if self._engine_memory is not None:
            self.args.offload_auto = False  # decided once, after the first training step
            self._engine_memory = None
        self.timings["update_weights"] = time.perf_counter() - start
        if self.weight_version > self.args.start_rollout_id:  # not the initial sync
            self.tracker.log(metrics, self.weight_version - 1, "perf")
        return metrics

    # ------------------------------------------------------------------ colocated offload, decided by measurement

    #: the share of a device that trainer and engines may hold together before offloading is needed
    RESIDENT_FRACTION = 0.92

    def _auto_offload_pending(self) -> bool:
        return bool(self.args.offload_auto) and self.actor is not None

    def _fits_without_offload(self) -> bool:
        """After the first training step: do the engines' memory (measured before they released it)
        and the trainer's peak (measured during the step) fit on every device together? Then both stay
        resident for the rest of the run and no step pays for offloading."""
        before = self._engine_memory
        if before is None or any(m is None for m in before):
            return False  # CPU (offloading is free there) or not measured yet (the first sync)
        now = self.actor.device_memory()
        if any(m is None for m in now):
            return False
        fits = []
        for rank, (engine, trainer) in enumerate(zip(before, now)):
            need = engine["used"] + trainer["peak_reserved"]
            fits.append(need <= self.RESIDENT_FRACTION * trainer["total"])
            logger.info("colocated memory, rank %d: engines + the rest %.1f GiB, trainer peak %.1f GiB, device %.1f GiB",
                        rank, engine["used"] / 2**30, trainer["peak_reserved"] / 2**30, trainer["total"] / 2**30)
        if all(fits):
            logger.info("trainer and engines fit on the device together (<= %.0f%%): offloading turned off for the "
                        "rest of the run (give --offload-train / --offload-rollout to force it)", 100 * self.RESIDENT_FRACTION)
        else:
            logger.info("trainer and engines do not fit together: offloading stays on")
        return all(fits)

    def evaluate(self, rollout_id: int) -> dict:
        metrics = ray.get(self.rollout_manager.eval.remote(rollout_id))
        self.tracker.log(metrics, rollout_id, "eval")
        self.tracker.console_eval(rollout_id, metrics)
        return metrics

    def should_save(self, rollout_id: int) -> bool:
        args = self.args
        if args.save_interval is None:
            return False
        return (rollout_id + 1) % args.save_interval == 0 or rollout_id + 1 == args.num_rollout

    def should_eval(self, rollout_id: int) -> bool:
        args = self.args
        if args.eval_interval is None or args.debug_train_only:
            return False
        return (rollout_id + 1) % args.eval_interval == 0 or rollout_id + 1 == args.num_rollout

    def eval_before_train(self, rollout_id: int) -> bool:
        args = self.args
        return rollout_id == 0 and args.eval_interval is not None and not args.skip_eval_before_train and not args.debug_train_only

    def log_step(self, rollout_id: int, rollout_metrics: dict, train_metrics: dict, step_time: float, wait_time: float) -> None:
        perf = {f"perf/{name}_time": seconds for name, seconds in self.timings.items()}
        perf["perf/step_time"] = step_time
        perf["perf/wait_time_ratio"] = wait_time / step_time if step_time > 0 else 0.0
        self.tracker.log(perf, rollout_id, "perf")
        self.tracker.console(rollout_id, {**rollout_metrics, **train_metrics, **perf})
        self.timings = {}

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, dispose_timeout: float = 180) -> None:
        """Trainers, then the rollout manager (router before engines), then Ray. Safe to call twice.
        A rollout manager that has not stopped within ``dispose_timeout`` s is killed; the engine and
        router processes die with it (``die_with_parent``)."""
        for group in (self.actor, self.critic):
            if group is not None and self.args.async_save:
                try:  # the end of the run waits for the checkpoint still being written
                    group.wait_for_save()
                except Exception as e:
                    logger.error("the last --async-save checkpoint was not completed: %s", e)
        for group in (self.actor, self.critic):
            if group is not None:
                group.shutdown()
        self.actor = self.critic = None
        if self.rollout_manager is not None:
            try:
                ray.get(self.rollout_manager.dispose.remote(), timeout=dispose_timeout)
            except Exception as e:  # still stop Ray, which kills what is left
                logger.warning("rollout manager did not shut down cleanly: %s", e)
            ray.kill(self.rollout_manager)
            self.rollout_manager = None
        self.tracker.close()
        for placement in getattr(self, "placements", {}).values():
            if placement.group is not None:
                try:
                    ray.util.remove_placement_group(placement.group)
                except Exception:
                    pass
        self.placements = {}
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()

"""Fully asynchronous rollout: generation never stops for training; each step takes the groups that finished.

``--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async`` with
``train.py``. The first call starts one :class:`AsyncRolloutWorker` on slime's background rollout
loop (a daemon thread of the rollout manager, :mod:`slime.utils.async_utils`). The worker pulls one
prompt group at a time from the data source and keeps up to ``--sglang-server-concurrency`` ×
engines groups generating, with at most ``--rollout-batch-size`` groups drawn and not yet handed over
(so it runs one step ahead of the trainer). Each call of the rollout function hands over exactly ``--rollout-batch-size``
completed groups (sorted by index; the surplus stays queued for the next step). Meanwhile the
trainer trains and pushes new weights into the running engines.

Staleness. Every sample records the engines' ``weight_version`` of each generation call
(``Sample.weight_versions``). A group's staleness is the engines' current version minus the oldest
version any of its samples was generated with; with ``--max-weight-staleness N`` groups staler than
N are dropped (their prompts are not retried). What is kept is off-policy by up to N versions:
``--use-tis`` reweights each token by π_old / μ (the trainer's recomputed log-prob over the engine's),
which corrects it.

Weight updates abort the requests in flight (the trainer pauses the engines with ``abort``); a group
with an ABORTED sample goes back to the data source and its samples continue from their tokens with
the new weights (their ``weight_versions`` then hold both versions).

Not supported: ``--colocate`` (generation and training cannot overlap on shared devices) and
evaluation (with ``--eval-function-path`` unset, runs with this rollout function evaluate with
``slime.rollout.sglang_rollout.generate_rollout``). Groups in flight when a checkpoint is saved
are not part of it: a resumed run draws new prompts where the data source stopped.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.engine_control import get_engine_urls
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group, get_num_engines
from slime.utils.async_utils import get_loop, run
from slime.utils.http_utils import get
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

__all__ = ["AsyncRolloutWorker", "generate_rollout_fully_async", "group_staleness"]


def _leaves(value) -> list[Sample]:
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _first_index(group) -> int:
    return min((s.index for s in _leaves(group) if s.index is not None), default=0)


def _version(tag) -> int | None:
    try:
        return int(tag)
    except (TypeError, ValueError):  # e.g. "default": an engine that has not been synced yet
        return None


def group_staleness(group, current_version: int | None) -> int | None:
    """Weight versions between the engines' current one and the oldest token of the group
    (None when the engines or the samples report no numeric version)."""
    versions = [v for s in _leaves(group) for v in map(_version, s.weight_versions) if v is not None]
    if current_version is None or not versions:
        return None
    return current_version - min(versions)


async def current_weight_version(args) -> int | None:
    """The newest weight version the engines serve (``GET /get_weight_version`` on each)."""
    versions = []
    for url in await get_engine_urls(args):
        answer = await get(f"{url}/get_weight_version")
        versions.append(_version(answer.get("weight_version") if isinstance(answer, dict) else answer))
    known = [v for v in versions if v is not None]
    return max(known) if known else None


class AsyncRolloutWorker:
    """Keeps prompt groups generating on the rollout loop and queues the completed ones.

    Counters (reported with each step's metrics): ``requeued`` groups put back because a sample was
    aborted, ``dropped_stale`` groups older than ``--max-weight-staleness``.
    """

    def __init__(self, args, data_source):
        self.args = args
        self.data_source = data_source
        per_engine = int(args.sglang_server_concurrency or 512)
        self.max_in_flight = max(1, min(per_engine * get_num_engines(args), args.rollout_batch_size))
        self.completed: list = []
        self.in_flight: set[asyncio.Task] = set()
        self.requeued = 0
        self.dropped_stale = 0
        self.error: BaseException | None = None
        self._changed: asyncio.Event | None = None  # created on the loop
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ------------------------------------------------------------------ the background task

    def start(self) -> None:
        """Start the worker task on the rollout loop (returns at once)."""

        async def _spawn():
            self._changed = asyncio.Event()
            GenerateState(self.args).reset()
            self._task = asyncio.create_task(self._run(), name="fully_async_rollout_worker")

        run(_spawn())

    async def _run(self) -> None:
        state = GenerateState(self.args)
        try:
            while not self._stopping:
                # one group at a time while there is room, one step ahead of the trainer: a deeper queue only
                # goes stale (docs/performance.md)
                while (len(self.in_flight) < self.max_in_flight
                       and len(self.completed) + len(self.in_flight) < self.args.rollout_batch_size):
                    groups = self.data_source.get_samples(1)
                    if not groups:
                        if not self.in_flight and not self.completed:
                            raise RuntimeError(f"the data source ({type(self.data_source).__name__}) returned no "
                                               "prompt group and none is generating: nothing left to train on")
                        break
                    group = groups[0]
                    coro = generate_and_rm_group(self.args, group, copy.deepcopy(state.sampling_params))
                    self.in_flight.add(asyncio.create_task(coro, name=f"fully_async_group[{_first_index(group)}]"))
                # wake on a finished group, or on a step that took groups (room to draw again)
                self._changed.clear()
                woken = asyncio.create_task(self._changed.wait(), name="fully_async_worker_wake")
                done, _ = await asyncio.wait(self.in_flight | {woken}, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                done.discard(woken)
                self.in_flight -= done
                for task in done:
                    group = task.result()
                    if any(s.status == Sample.Status.ABORTED for s in _leaves(group)):
                        self.requeued += 1  # a weight update aborted it: continue with the new weights
                        self.data_source.add_samples([group])
                    else:
                        self.completed.append(group)
                if done:
                    self._changed.set()
        except BaseException as exc:  # reported to the next collect(), which raises it
            if not isinstance(exc, asyncio.CancelledError):
                logger.exception("fully async rollout worker failed")
                self.error = exc
            for task in self.in_flight:
                task.cancel()
            await asyncio.gather(*self.in_flight, return_exceptions=True)
            self._changed.set()
            if isinstance(exc, asyncio.CancelledError):
                raise

    # ------------------------------------------------------------------ one training step

    async def collect(self, target: int) -> tuple[list, dict]:
        """Wait for ``target`` completed groups that are fresh enough; return them and the step's metrics."""
        max_staleness = self.args.max_weight_staleness
        requeued, dropped = self.requeued, self.dropped_stale
        batch, staleness = [], []
        while len(batch) < target:
            if self.error is not None:
                raise RuntimeError(f"the fully async rollout worker stopped: {self.error!r}") from self.error
            if not self.completed:
                self._changed.clear()
                await self._changed.wait()
                continue
            current = await current_weight_version(self.args)
            ready, self.completed = self.completed, []
            for group in sorted(ready, key=_first_index):
                lag = group_staleness(group, current)
                if len(batch) >= target:
                    self.completed.append(group)  # surplus: next step's
                elif max_staleness is not None and lag is not None and lag > max_staleness:
                    self.dropped_stale += 1
                else:
                    batch.append(group)
                    staleness.append(lag)
            self._changed.set()  # room freed: the worker draws again
        known = [s for s in staleness if s is not None]
        metrics = {"rollout/fully_async/requeued_groups": self.requeued - requeued,
                   "rollout/fully_async/dropped_stale_groups": self.dropped_stale - dropped,
                   "rollout/fully_async/queued_groups": len(self.completed),
                   "rollout/fully_async/in_flight_groups": len(self.in_flight)}
        if known:
            metrics["rollout/fully_async/staleness_mean"] = sum(known) / len(known)
            metrics["rollout/fully_async/staleness_max"] = max(known)
        return sorted(batch, key=_first_index), metrics

    def stop(self) -> None:
        """Cancel the worker and its in-flight groups (their prompts are not put back)."""
        self._stopping = True

        async def _cancel():
            if self._task is not None and not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

        if self._task is not None:
            asyncio.run_coroutine_threadsafe(_cancel(), get_loop()).result(timeout=60)


_worker: AsyncRolloutWorker | None = None
_worker_lock = threading.Lock()


def get_worker(args, data_source) -> AsyncRolloutWorker:
    """The process's worker, started on first use (a new ``args`` or data source starts a new one)."""
    global _worker
    with _worker_lock:
        if _worker is not None and (_worker.args is not args or _worker.data_source is not data_source):
            _worker.stop()
            _worker = None
        if _worker is None:
            _worker = AsyncRolloutWorker(args, data_source)
            _worker.start()
        return _worker


def stop_worker() -> None:
    """Stop the process's worker, if any (tests; a job's shutdown kills the rollout manager anyway)."""
    global _worker
    with _worker_lock:
        if _worker is not None:
            _worker.stop()
            _worker = None


def generate_rollout_fully_async(args, rollout_id, data_source, evaluation=False):
    """``--rollout-function-path``: the next ``--rollout-batch-size`` groups the background worker completed."""
    if evaluation:
        raise ValueError("generate_rollout_fully_async does not evaluate; pass --eval-function-path "
                         "slime.rollout.sglang_rollout.generate_rollout (the default when the flag is unset)")
    if args.colocate:
        raise ValueError("the fully async rollout generates while the trainer trains, which --colocate (shared "
                         "devices, offloaded in turn) cannot do; drop --colocate")
    worker = get_worker(args, data_source)
    groups, metrics = run(worker.collect(args.rollout_batch_size))
    logger.info("fully async rollout %s: %s", rollout_id, metrics)
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)


generate_rollout_fully_async.overlaps_training = True  # read by Job: engines and trainers run at once

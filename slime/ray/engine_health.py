"""The rollout health monitor (``--use-fault-tolerance``): a heartbeat per engine while a rollout runs.

Every ``--rollout-health-check-interval`` seconds each engine gets ``GET /health_generate`` (the
SGLang probe: a 1-token request, answered as soon as the engine produces any token) with a deadline
of ``--rollout-health-check-timeout`` seconds; the router the rollout manager launched gets
``GET /liveness``. A target that does not answer 200 in time — dead, or hung (a stopped or stuck
process still accepts connections but never answers) — is handed to ``recover(index, reason)``,
which the rollout manager implements (an engine: take it out of the router, kill it, restart it,
give it the current weights, register it again; the router: restart it on its port). No target is
probed until ``--rollout-health-check-first-wait`` seconds after it came up (start-up or restart).

It only runs while the rollout manager generates or evaluates: between rollouts the engines are
paused for weight updates or have released their memory, and a probe then would fail by design.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

logger = logging.getLogger(__name__)

ENGINE_PROBE_PATH = "/health_generate"
ROUTER_PROBE_PATH = "/liveness"


def probe(url: str, timeout: float) -> str | None:
    """None when ``GET url`` (a probe endpoint) answers 200 within ``timeout`` seconds, else why not."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.TimeoutException:
        return f"no answer to GET {url} within {timeout:g} s (hung)"
    except httpx.HTTPError as e:
        return f"GET {url} failed: {type(e).__name__}: {e} (dead)"
    if response.status_code != 200:
        return f"GET {url} answered HTTP {response.status_code}"
    return None


class EngineHealthMonitor:
    """Probes ``probe_urls()`` (one probe endpoint per target) from a background thread between
    :meth:`start` and :meth:`stop`.

    ``up_since[i]`` is when target ``i`` last became healthy (``time.monotonic()``); the caller
    updates it after a restart. ``recover`` runs on the monitor's thread, one target at a time, and
    :meth:`stop` waits for a recovery in progress, so a rollout step never ends with an engine half
    restarted.
    """

    def __init__(self, probe_urls: Callable[[], list[str]], recover: Callable[[int, str], None], interval: float,
                 timeout: float, first_wait: float = 0.0, probe: Callable[[str, float], str | None] = probe):
        if interval <= 0 or timeout <= 0 or first_wait < 0:
            raise ValueError(f"--rollout-health-check-interval ({interval}) and --rollout-health-check-timeout "
                             f"({timeout}) must be > 0 and --rollout-health-check-first-wait ({first_wait}) >= 0")
        self.probe_urls, self.recover, self.probe = probe_urls, recover, probe
        self.interval, self.timeout, self.first_wait = interval, timeout, first_wait
        self.up_since: dict[int, float] = {}
        self.recovered: list[tuple[int, str]] = []  # (target index, why), in the order they were recovered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def mark_up(self, index: int) -> None:
        self.up_since[index] = time.monotonic()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine health monitor is already running")
        self._stop.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="engine-health-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop probing; wait for a recovery in progress; re-raise a recovery that failed."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the rollout health monitor could not recover a failed engine or router: {error}") from error

    def _due(self, index: int, now: float) -> bool:
        return now - self.up_since.get(index, float("-inf")) >= self.first_wait

    def _run(self) -> None:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-health-probe") as pool:
            while not self._stop.is_set():
                urls = self.probe_urls()
                now = time.monotonic()
                due = [i for i in range(len(urls)) if self._due(i, now)]
                # probed together: one hung engine costs the round its timeout, not one timeout per engine
                verdicts = list(pool.map(lambda i: self.probe(urls[i], self.timeout), due))
                for index, reason in zip(due, verdicts):
                    if reason is None:
                        continue
                    logger.warning("health check %d failed: %s; restarting it", index, reason)
                    try:
                        self.recover(index, reason)
                    except BaseException as e:  # reported by stop(); the rollout cannot go on without it
                        logger.error("recovering target %d failed: %s", index, e, exc_info=e)
                        self._error = e
                        return
                    self.recovered.append((index, reason))
                    self.mark_up(index)
                self._stop.wait(self.interval)

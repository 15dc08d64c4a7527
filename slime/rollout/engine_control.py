"""Engine-side control used by the default rollout: which engines exist, aborting them, waiting for idle.

The router does not forward ``/abort_request`` or ``/v1/loads`` (docs/SGLANG_PROTOCOL.md §11.4), so these
go to every engine directly. Engine URLs come from ``args.rollout_engine_urls`` (set by the rollout
manager); without it they are read from the router's ``GET /workers``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from slime.utils.http_utils import HTTPRequestError, get, post
from slime.utils.errors import UserError

logger = logging.getLogger(__name__)

ABORT_REPEAT_INTERVAL_S = 3.0
IDLE_WAIT_TIMEOUT_S = 120.0


def router_base_url(args) -> str:
    if not args.sglang_router_ip or not args.sglang_router_port:
        raise ValueError("the default rollout needs the router address: args.sglang_router_ip / sglang_router_port")
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


async def get_engine_urls(args) -> list[str]:
    """Base URLs ("http://host:port") of every engine: ``args.rollout_engine_urls`` or the router's list."""
    urls = args.rollout_engine_urls
    if urls:
        return [u.rstrip("/") for u in urls]
    answer = await get(router_base_url(args) + "/workers")
    workers = answer.get("workers", []) if isinstance(answer, dict) else answer or []
    urls = [w["url"].rstrip("/") if isinstance(w, dict) else str(w).rstrip("/") for w in workers]
    if not urls:
        raise RuntimeError(f"router {router_base_url(args)} lists no workers; cannot abort generation")
    return urls


async def abort_all(engine_urls: list[str]) -> None:
    """``POST /abort_request {"abort_all": true}`` to every engine, concurrently."""
    tasks = [
        asyncio.create_task(post(f"{url}/abort_request", {"abort_all": True}, max_retries=3), name=f"abort[{url}]")
        for url in engine_urls
    ]
    for url, outcome in zip(engine_urls, await asyncio.gather(*tasks, return_exceptions=True)):
        if isinstance(outcome, BaseException):
            logger.warning("abort_request to %s failed: %s", url, outcome)


async def _in_flight(url: str) -> int | None:
    """Running + waiting requests of one engine, or None when it does not serve ``/v1/loads``."""
    try:
        answer = await get(f"{url}/v1/loads", params={"include": "core"})
    except HTTPRequestError as e:
        if e.status_code == 404:
            return None
        if e.status_code is None:  # unreachable: killed or restarting (health monitor), so it runs nothing of ours
            logger.warning("engine %s unreachable while waiting for it to go idle: %s", url, e)
            return 0
        raise
    loads = answer.get("loads", []) if isinstance(answer, dict) else []
    return sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads)


async def wait_until_idle(engine_urls: list[str], timeout_s: float = IDLE_WAIT_TIMEOUT_S) -> None:
    """Poll ``/v1/loads`` until no engine has running or waiting requests, re-aborting every 3 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await asyncio.gather(*(_in_flight(u) for u in engine_urls))
        busy = {u: c for u, c in zip(engine_urls, counts) if c}
        if not busy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines still busy {timeout_s:.0f}s after abort_request: {busy}")
        await asyncio.sleep(ABORT_REPEAT_INTERVAL_S)
        await abort_all(list(busy))


ENGINE_COUNTERS = ("busy_seconds", "decode_seconds", "prefill_seconds", "decode_steps", "prefill_forwards",
                   "generated_tokens")


def engine_counters(engine_urls: list[str]) -> dict[str, float] | None:
    """The embedded engines' step counters (``/get_server_info`` → ``batch_stats``) summed over
    engines; None when an engine does not report them (SGLang) or cannot be reached."""
    import httpx

    from slime.utils.http_utils import sync_client

    totals = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    try:
        for url in engine_urls:
            stats = sync_client().get(f"{url.rstrip('/')}/get_server_info", timeout=10).json().get("batch_stats")
            if not isinstance(stats, dict) or any(key not in stats for key in ENGINE_COUNTERS):
                return None
            for key in ENGINE_COUNTERS:
                totals[key] += float(stats[key])
    except (httpx.HTTPError, ValueError) as exc:
        logger.debug("engine counters unavailable: %s", exc)
        return None
    return totals


def engine_time_metrics(before: dict | None, after: dict | None, rollout_time: float, num_engines: int) -> dict:
    """Where a rollout step's time went inside the engines: ``perf/engine_busy_fraction`` (time in
    engine steps over the step's wall time, mean over engines), decode and prefill seconds per engine,
    decode steps and prefill forwards (totals). Empty when the engines keep no counters."""
    if before is None or after is None or rollout_time <= 0 or num_engines <= 0:
        return {}
    delta = {key: after[key] - before[key] for key in ENGINE_COUNTERS}
    return {"perf/engine_busy_fraction": delta["busy_seconds"] / num_engines / rollout_time,
            "perf/engine_decode_time": delta["decode_seconds"] / num_engines,
            "perf/engine_prefill_time": delta["prefill_seconds"] / num_engines,
            "perf/engine_decode_steps": delta["decode_steps"], "perf/engine_prefill_forwards": delta["prefill_forwards"]}


class EngineDead(UserError):
    """An engine stopped answering while the run has no fault tolerance to restart it (reported in one message)."""


def engine_dead_error(dead: list[str], error: BaseException) -> EngineDead:
    error = getattr(error, "cause", None) or error  # a Ray task error: the exception raised in the actor
    return EngineDead(f"rollout engine(s) {', '.join(dead)} stopped answering: the engine process died (its log "
                      f"says why). slime restarts dead engines only with --use-fault-tolerance: rerun with it (and "
                      f"--load to resume from the last checkpoint). Last error: {type(error).__name__}: {error}")


def raise_if_engines_dead_sync(engine_urls: list[str], error: BaseException, timeout_s: float = 3.0) -> None:
    """:func:`raise_if_engines_dead` for the driver (a weight push that failed)."""
    import httpx

    dead = []
    for url in engine_urls:
        try:
            status = httpx.get(f"{url}/health", timeout=timeout_s).status_code
            if status >= 500:
                dead.append(f"{url} (/health answered {status})")
        except httpx.HTTPError as e:
            dead.append(f"{url} ({type(e).__name__}: {e or 'no answer'})")
    if dead:
        raise engine_dead_error(dead, error) from None


async def raise_if_engines_dead(args, error: BaseException, timeout_s: float = 3.0) -> None:
    """After requests have failed: probe every engine's ``/health``; if one does not answer, raise
    :class:`EngineDead` naming it and ``--use-fault-tolerance`` (a restart is what would have saved the run)."""
    import aiohttp

    try:
        urls = await get_engine_urls(args)
    except Exception:
        return  # no list of engines (the router is down too): the retries report what failed
    dead = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for url in urls:
            try:
                async with session.get(f"{url}/health") as response:
                    if response.status >= 500:
                        dead.append(f"{url} (/health answered {response.status})")
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                dead.append(f"{url} ({type(e).__name__}: {e or 'no answer'})")
    if dead:
        raise engine_dead_error(dead, error)


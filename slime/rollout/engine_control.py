"""Engine-side control used by the default rollout: which engines exist, aborting them, waiting for idle.

The router does not forward ``/abort_request`` or ``/v1/loads`` (SGLANG_PROTOCOL §11.4), so these
go to every engine directly. Engine URLs come from ``args.rollout_engine_urls`` (set by the rollout
manager); without it they are read from the router's ``GET /workers``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from slime.utils.http_utils import HTTPRequestError, get, post

logger = logging.getLogger(__name__)

ABORT_REPEAT_INTERVAL_S = 3.0
IDLE_WAIT_TIMEOUT_S = 120.0


def router_base_url(args) -> str:
    if not getattr(args, "sglang_router_ip", None) or not getattr(args, "sglang_router_port", None):
        raise ValueError("the default rollout needs the router address: args.sglang_router_ip / sglang_router_port")
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


async def get_engine_urls(args) -> list[str]:
    """Base URLs ("http://host:port") of every engine: ``args.rollout_engine_urls`` or the router's list."""
    urls = getattr(args, "rollout_engine_urls", None)
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

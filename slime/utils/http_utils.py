"""Process-global async HTTP client for talking to the router, the engines and remote reward models.

``init_http_client(args, num_engines)`` sizes the connection pool (``--sglang-server-concurrency`` × engines) and
the timeout once per process; ``post``/``get`` then reuse one ``httpx.AsyncClient`` per event loop
(an httpx client is bound to the loop it first ran on, and slime normally has exactly one: the
background loop of :mod:`slime.utils.async_utils`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import weakref
from typing import Any

import httpx

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_S = 14400.0  # generation requests may legitimately run for hours (long agent rollouts)
_pool_size = 1024
_timeout_s = _DEFAULT_TIMEOUT_S
_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]" = weakref.WeakKeyDictionary()
_sync_client: httpx.Client | None = None
_sync_lock = threading.Lock()


class HTTPRequestError(RuntimeError):
    """A request that the server answered with a client error (4xx), or that failed on every retry."""

    def __init__(self, message: str, status_code: int | None = None, body: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.body = body


def init_http_client(args, num_engines: int = 1) -> None:
    """Configure the pool size (``--sglang-server-concurrency`` per engine, ``num_engines`` engines)
    and the timeout from ``args``; existing clients are closed lazily."""
    global _pool_size, _timeout_s
    if num_engines < 1:
        raise ValueError(f"init_http_client: num_engines must be >= 1, got {num_engines}")
    concurrency = int(getattr(args, "sglang_server_concurrency", None) or 512)
    _pool_size = max(64, concurrency * num_engines)
    _timeout_s = float(getattr(args, "http_timeout_s", None) or _DEFAULT_TIMEOUT_S)
    _clients.clear()


def get_client() -> httpx.AsyncClient:
    """The shared client of the running event loop (created on first use in that loop)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        limits = httpx.Limits(max_connections=_pool_size, max_keepalive_connections=_pool_size)
        client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(_timeout_s))
        _clients[loop] = client
    return client


def sync_client() -> httpx.Client:
    """The process's blocking client for short admin calls to the engines (step counters, memory
    release/resume, weight versions). ``httpx.get``/``httpx.post`` build a client per call, ~20 ms of
    Python each (its SSL context) — the loop paid that several times a step. Pass ``timeout`` per call."""
    global _sync_client
    with _sync_lock:
        if _sync_client is None or _sync_client.is_closed:
            _sync_client = httpx.Client(timeout=httpx.Timeout(60.0))
        return _sync_client


async def close_client() -> None:
    """Close the running loop's client (part of the rollout side's shutdown order)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


def _decode(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except (json.JSONDecodeError, ValueError):
        return response.text


async def post(url: str, payload: dict | None, max_retries: int = 60, headers: dict | None = None) -> Any:
    """POST ``payload`` as JSON and return the parsed JSON body (raw text if not JSON, None if empty).

    Connection errors, timeouts and 5xx answers are retried every second up to ``max_retries``
    attempts (an engine may be restarting); a 4xx answer is the caller's fault and raises
    :class:`HTTPRequestError` at once with the server's message.
    """
    last_error: str = ""
    for attempt in range(1, max_retries + 1):
        try:
            response = await get_client().post(url, json=payload, headers=headers)
        except httpx.HTTPError as e:
            last_error = f"{type(e).__name__}: {e}"
        else:
            if response.status_code < 400:
                return _decode(response)
            if response.status_code < 500:
                raise HTTPRequestError(
                    f"POST {url} answered {response.status_code}: {response.text[:2000]}",
                    status_code=response.status_code,
                    body=response.text,
                )
            last_error = f"HTTP {response.status_code}: {response.text[:500]}"
        if attempt < max_retries:
            logger.warning("POST %s failed (attempt %d/%d): %s; retrying in 1 s", url, attempt, max_retries, last_error)
            await asyncio.sleep(1.0)
    raise HTTPRequestError(f"POST {url} failed after {max_retries} attempts; last error: {last_error}")


async def get(url: str, params: dict | None = None, headers: dict | None = None) -> Any:
    """GET ``url`` and return the parsed JSON body; raises :class:`HTTPRequestError` on an HTTP error."""
    try:
        response = await get_client().get(url, params=params, headers=headers)
    except httpx.HTTPError as e:
        raise HTTPRequestError(f"GET {url} failed: {type(e).__name__}: {e}") from e
    if response.status_code >= 400:
        raise HTTPRequestError(
            f"GET {url} answered {response.status_code}: {response.text[:2000]}",
            status_code=response.status_code,
            body=response.text,
        )
    return _decode(response)

"""Process-global async HTTP client for talking to the router, the engines and remote reward models.

``init_http_client(args, num_engines)`` sizes the connection pool (``--sglang-server-concurrency`` × engines) and
the timeout once per process; ``post``/``get`` then reuse one ``aiohttp.ClientSession`` per event loop
(a session is bound to the loop it was made in, and slime normally has exactly one: the background
loop of :mod:`slime.utils.async_utils`).

aiohttp rather than httpx for the rollout's requests: httpx's pure-Python parsing takes a burst of answers
one after another, several times slower than the engine sends them (docs/loop.md, "Speed of the loop"). The
blocking admin client (:func:`sync_client`) stays httpx. Bodies are encoded and parsed with orjson (json for
what orjson refuses), a few times faster than json on answers with log-probs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import weakref
from typing import Any

import aiohttp
import httpx
import orjson

from slime.utils.misc import custom_config_value

logger = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_S = 14400.0  # generation requests may legitimately run for hours (long agent rollouts)
_pool_size = 1024
_timeout_s = _DEFAULT_TIMEOUT_S
_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]" = weakref.WeakKeyDictionary()
_sync_client: httpx.Client | None = None
_sync_lock = threading.Lock()
#: what a failed attempt raises: no connection, a reset, a timeout (retried like a 5xx answer)
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class HTTPRequestError(RuntimeError):
    """A request that the server answered with a client error (4xx), or that failed on every retry."""

    def __init__(self, message: str, status_code: int | None = None, body: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.body = body


def init_http_client(args, num_engines: int = 1) -> None:
    """Configure the pool size (``--sglang-server-concurrency`` per engine, ``num_engines`` engines)
    and the timeout from ``args``; sessions made before keep theirs until closed."""
    global _pool_size, _timeout_s
    if num_engines < 1:
        raise ValueError(f"init_http_client: num_engines must be >= 1, got {num_engines}")
    concurrency = int(args.sglang_server_concurrency or 512)
    _pool_size = max(64, concurrency * num_engines)
    _timeout_s = float(custom_config_value(args, "http_timeout_s") or _DEFAULT_TIMEOUT_S)
    _sessions.clear()


def get_client() -> aiohttp.ClientSession:
    """The shared session of the running event loop (created on first use in that loop)."""
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(limit=_pool_size, limit_per_host=0)
        session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=_timeout_s))
        _sessions[loop] = session
    return session


def sync_client() -> httpx.Client:
    """The process's blocking client for short admin calls to the engines (step counters, memory
    release/resume, weight versions). ``httpx.get``/``httpx.post`` build a client per call (its SSL
    context costs milliseconds of Python), which the loop would pay several times a step. Pass ``timeout`` per call."""
    global _sync_client
    with _sync_lock:
        if _sync_client is None or _sync_client.is_closed:
            _sync_client = httpx.Client(timeout=httpx.Timeout(60.0))
        return _sync_client


async def close_client() -> None:
    """Close the running loop's session (part of the rollout side's shutdown order)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


def json_dumps(obj: Any) -> bytes:
    """JSON bytes by orjson (numpy arrays and scalars as lists and numbers, non-string keys as strings; NaN and
    infinities as null, as SGLang's orjson answers have them), by json for what orjson refuses (integers beyond
    64 bits). The engine's answers and the rollout's requests both go through it."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(obj).encode()


def json_loads(raw: bytes | str) -> Any:
    """Parse JSON by orjson, by json for what only json takes (NaN, Infinity); invalid JSON raises
    ``json.JSONDecodeError`` in json's words (line and column)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _decode(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json_loads(body)
    except (ValueError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
        return body.decode("utf-8", errors="replace")


async def post(url: str, payload: dict | None, max_retries: int = 60, headers: dict | None = None) -> Any:
    """POST ``payload`` as JSON and return the parsed JSON body (raw text if not JSON, None if empty).

    Connection errors, timeouts and 5xx answers are retried every second up to ``max_retries``
    attempts (an engine may be restarting); a 4xx answer is the caller's fault and raises
    :class:`HTTPRequestError` at once with the server's message.
    """
    last_error: str = ""
    data = None if payload is None else json_dumps(payload)  # None: an empty body, as aiohttp's json=None sends
    if data is not None:
        headers = {"Content-Type": "application/json", **(headers or {})}
    for attempt in range(1, max_retries + 1):
        try:
            async with get_client().post(url, data=data, headers=headers) as response:
                status, body = response.status, await response.read()
        except TRANSPORT_ERRORS as e:
            last_error = f"{type(e).__name__}: {e}"
        else:
            if status < 400:
                return _decode(body)
            text = body.decode("utf-8", errors="replace")
            if status < 500:
                raise HTTPRequestError(f"POST {url} answered {status}: {text[:2000]}", status_code=status, body=text)
            last_error = f"HTTP {status}: {text[:500]}"
        if attempt < max_retries:
            logger.warning("POST %s failed (attempt %d/%d): %s; retrying in 1 s", url, attempt, max_retries, last_error)
            await asyncio.sleep(1.0)
    raise HTTPRequestError(f"POST {url} failed after {max_retries} attempts; last error: {last_error}")


async def get(url: str, params: dict | None = None, headers: dict | None = None) -> Any:
    """GET ``url`` and return the parsed JSON body; raises :class:`HTTPRequestError` on an HTTP error."""
    try:
        async with get_client().get(url, params=params, headers=headers) as response:
            status, body = response.status, await response.read()
    except TRANSPORT_ERRORS as e:
        raise HTTPRequestError(f"GET {url} failed: {type(e).__name__}: {e}") from e
    if status >= 400:
        text = body.decode("utf-8", errors="replace")
        raise HTTPRequestError(f"GET {url} answered {status}: {text[:2000]}", status_code=status, body=text)
    return _decode(body)

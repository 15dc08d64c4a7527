"""Remote reward model (``rm_type == "remote_rm"``): POST the sample to ``--rm-url``.

Request JSON ``{"prompt", "response", "label"}``; the server's JSON answer is the reward as is.
Up to ``max_retries`` attempts with exponential backoff (1 s, 2 s, 4 s, ... capped at 30 s, plus up
to 20 % jitter), a 120 s timeout per attempt, and after the last attempt a ``RemoteRewardError``
naming the URL, the attempts and the last failure.
"""

from __future__ import annotations

import asyncio
import logging
import random
import weakref

import httpx

logger = logging.getLogger(__name__)

BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 30.0
REQUEST_TIMEOUT_S = 120.0
_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]" = weakref.WeakKeyDictionary()


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or kept failing."""


def _client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
        )
        _clients[loop] = client
    return client


async def remote_rm(args, sample, max_retries: int = 10):
    """POST ``sample`` to ``args.rm_url`` and return the decoded JSON reward."""
    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError("rm_type 'remote_rm' needs --rm-url (the reward server endpoint)")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    last_error = ""
    for attempt in range(1, max_retries + 1):
        try:
            response = await _client().post(url, json=payload, timeout=REQUEST_TIMEOUT_S)
            if response.status_code < 400:
                return response.json()
            last_error = f"HTTP {response.status_code}: {response.text[:300]}"
        except (httpx.HTTPError, ValueError) as e:
            last_error = f"{type(e).__name__}: {e}"
        if attempt < max_retries:
            delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1))
            delay += random.uniform(0, 0.2 * delay)
            logger.warning("remote_rm %s attempt %d/%d failed (%s); retry in %.2fs", url, attempt, max_retries,
                           last_error, delay)  # fmt: skip
            await asyncio.sleep(delay)
    raise RemoteRewardError(f"remote reward model {url} failed after {max_retries} attempts; last error: {last_error}")

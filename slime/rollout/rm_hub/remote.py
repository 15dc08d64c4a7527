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

import aiohttp

from slime.utils import http_utils

logger = logging.getLogger(__name__)

BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 30.0
REQUEST_TIMEOUT_S = 120.0


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or kept failing."""


async def remote_rm(args, sample, max_retries: int = 10):
    """POST ``sample`` to ``args.rm_url`` and return the decoded JSON reward."""
    url = args.rm_url
    if not url:
        raise ValueError("rm_type 'remote_rm' needs --rm-url (the reward server endpoint)")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    last_error = ""
    for attempt in range(1, max_retries + 1):
        try:  # the rollout's shared session (slime.utils.http_utils), with this call's own timeout
            async with http_utils.get_client().post(url, data=http_utils.json_dumps(payload),
                                                    headers={"Content-Type": "application/json"},
                                                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as response:
                status, body = response.status, await response.read()
            if status < 400:
                return http_utils.json_loads(body)
            last_error = f"HTTP {status}: {body[:300].decode('utf-8', errors='replace')}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            last_error = f"{type(e).__name__}: {e}"
        if attempt < max_retries:
            delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1))
            delay += random.uniform(0, 0.2 * delay)
            logger.warning("remote_rm %s attempt %d/%d failed (%s); retry in %.2fs", url, attempt, max_retries,
                           last_error, delay)  # fmt: skip
            await asyncio.sleep(delay)
    raise RemoteRewardError(f"remote reward model {url} failed after {max_retries} attempts; last error: {last_error}")

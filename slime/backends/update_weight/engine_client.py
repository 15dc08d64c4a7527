"""The engines' admin endpoints (pause, flush, weight-update sessions) as one blocking client."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx

logger = logging.getLogger(__name__)


class EngineClient:
    """Blocking admin client for the engines' HTTP endpoints (one per trainer rank 0)."""

    def __init__(self, engine_urls: list[str], api_key: str | None = None, timeout: float = 600.0):
        self.engine_urls = list(engine_urls)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engine_urls)), thread_name_prefix="engine-admin")

    def post(self, url: str, path: str, payload: dict | None = None) -> dict:
        response = self._client.post(url + path, json=payload or {})
        if response.status_code != 200:
            raise RuntimeError(f"POST {url}{path} failed with {response.status_code}: {response.text[:500]}")
        try:
            body = response.json() if response.content else {}
        except ValueError:  # e.g. /flush_cache answers plain text, as SGLang does
            body = {"text": response.text}
        if isinstance(body, dict) and body.get("success") is False:
            raise RuntimeError(f"POST {url}{path} reported failure: {body.get('message')}")
        return body

    def post_all(self, path: str, payloads: list[dict] | dict | None = None) -> list[dict]:
        """POST to every engine concurrently (one payload each, or the same payload)."""
        if not isinstance(payloads, list):
            payloads = [payloads] * len(self.engine_urls)
        if len(self.engine_urls) == 1:  # no thread hop for one engine
            return [self.post(self.engine_urls[0], path, payloads[0])]
        futures = [self._pool.submit(self.post, url, path, p) for url, p in zip(self.engine_urls, payloads)]
        return [f.result() for f in futures]

    def submit_all(self, path: str, payload: dict):
        """Start POSTs to every engine without waiting (for calls that block on a collective)."""
        return [self._pool.submit(self.post, url, path, payload) for url in self.engine_urls]

    def pause(self) -> None:
        self.post_all("/pause_generation", {})
        self.post_all("/flush_cache", {})

    def resume(self) -> None:
        self.post_all("/continue_generation", {})

    @contextmanager
    def weight_update_session(self):
        """SGLang (since 0.5.2x) loads tensor and broadcast weights only inside a session:
        ``/begin_weight_update`` first, ``/end_weight_update`` after the last bucket (which
        finalizes the weights it restored for loading); outside one each update answers
        ``success: false``. The session is closed even when a bucket fails, so the next update can
        open one."""
        self.post_all("/begin_weight_update", {})
        try:
            yield
        except BaseException:
            try:
                self.post_all("/end_weight_update", {})
            except Exception as e:  # the update's own error is the one to report
                logger.warning("closing the weight-update session after a failed update failed too: %s", e)
            raise
        self.post_all("/end_weight_update", {})

    def close(self) -> None:
        self._client.close()
        self._pool.shutdown(wait=False)

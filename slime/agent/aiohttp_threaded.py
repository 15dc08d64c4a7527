"""Serve an aiohttp app (an agent adapter's ``app``) on a daemon thread with its own event loop.

    handle = run_app_in_thread(adapter.app)          # 127.0.0.1, a free port
    client = openai.AsyncOpenAI(base_url=handle.url + "/v1", api_key=session_id)
    ...
    handle.stop()

The default host is 127.0.0.1. Binding any other address exposes the adapter to other machines, and
agent clients authenticate with nothing but their session id, so the adapter is then switched to
strict mode: only sessions opened with ``open_session`` are served, anything else gets 401.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
from dataclasses import dataclass

from aiohttp import web

logger = logging.getLogger(__name__)


@dataclass
class AppHandle:
    host: str
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Close the server (running handlers finish or are cancelled) and end the thread."""
        if not self.loop.is_running():
            return
        future = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        try:
            future.result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run_app_in_thread(app: web.Application, *, host: str = "127.0.0.1", port: int = 0,
                      thread_name: str = "aiohttp-app", start_timeout_sec: float = 15.0,
                      runner_kwargs: dict | None = None) -> AppHandle:
    """Start ``app`` on ``host:port`` (port 0: a free one) and return once it accepts connections."""
    from slime.agent.adapters.common import ADAPTER_KEY

    adapter = app.get(ADAPTER_KEY)
    if adapter is not None and not is_loopback(host) and not adapter.strict:
        logger.warning("agent adapter bound to %s (not loopback): strict mode on, only opened sessions are served",
                       host)
        adapter.strict = True
    loop = asyncio.new_event_loop()
    started = threading.Event()
    result: dict = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, **(runner_kwargs or {}))
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            result["runner"] = runner
            result["port"] = runner.addresses[0][1]
        except BaseException as e:  # reported to the caller below
            result["error"] = e
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    if not started.wait(start_timeout_sec):
        raise TimeoutError(f"aiohttp app did not start on {host}:{port} within {start_timeout_sec}s")
    if "error" in result:
        raise RuntimeError(f"could not serve the app on {host}:{port}: {result['error']}") from result["error"]
    return AppHandle(host=host, port=result["port"], thread=thread, loop=loop, runner=result["runner"])

"""One background event loop for the rollout side.

Sync rollout functions (``generate_rollout(args, rollout_id, data_source, evaluation=False)``) drive
their async work through :func:`run`, which submits the coroutine to a single long-lived event loop
running on a daemon thread and blocks for the result. Keeping one loop for the whole process means
loop-bound objects (the HTTP client, semaphores) are created once and reused across rollout steps.

The loop thread is started lazily on the first :func:`run` call (no import-time side effects) and
stopped by :func:`shutdown_loop` (the rollout manager calls it at shutdown; tests may too).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """Return slime's background rollout loop, starting its thread on first use."""
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def _serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            thread = threading.Thread(target=_serve, name="slime-rollout-loop", daemon=True)
            thread.start()
            started.wait()
            _loop, _thread = loop, thread
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the background rollout loop and block until it returns (or raises).

    Must not be called from the loop's own thread (that would deadlock); call ``await coro`` there.
    """
    loop = get_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("async_utils.run() called from the rollout loop thread itself; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def shutdown_loop(timeout: float = 10.0) -> None:
    """Stop the background loop: cancel its remaining tasks, then stop and join the thread."""
    global _loop, _thread
    with _lock:
        loop, thread = _loop, _thread
        _loop, _thread = None, None
    if loop is None or loop.is_closed():
        return

    async def _cancel_remaining() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    if thread is not None and thread.is_alive():
        asyncio.run_coroutine_threadsafe(_cancel_remaining(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
    loop.close()

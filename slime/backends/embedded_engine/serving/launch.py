"""Start the embedded engine as a subprocess and wait for it (what tests and the Ray rollout use).

    engine = EmbeddedEngineProcess("/path/to/hf_dir", extra_args=["--context-length", "512"])
    engine.start(); engine.wait_healthy(timeout=120)
    ... engine.url ...
    engine.stop()   # SIGTERM: running requests are aborted and answered, then the process exits
"""

from __future__ import annotations

import contextlib
import sys

from slime.utils.process import ServerProcess, find_free_port

__all__ = ["EmbeddedEngineProcess", "running_engine", "ServerProcess", "find_free_port"]


class EmbeddedEngineProcess(ServerProcess):
    def __init__(self, model_path: str, port: int | None = None, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None, env: dict | None = None, api_key: str | None = None):
        super().__init__(host, port, env, api_key)
        self.model_path = str(model_path)
        self.extra_args = list(extra_args or [])

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "slime.backends.embedded_engine", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self.port), *self.extra_args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd


@contextlib.contextmanager
def running_engine(model_path: str, timeout: float = 120.0, **kwargs):
    """An embedded engine started and healthy for the ``with`` block, stopped after it (also on error)."""
    proc = EmbeddedEngineProcess(model_path, **kwargs)
    proc.start()
    try:
        proc.wait_healthy(timeout=timeout)
        yield proc
    finally:
        proc.stop()

"""Launching the servers slime runs as child processes (the embedded engine, SGLang servers, the
router): one class for all of them — a log file, a health URL, a clean stop, and a child that dies
with its owner.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

__all__ = ["ServerProcess", "die_with_parent", "find_free_port"]


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the process that started it dies (even by SIGKILL), so a
    crashed owner (a Ray actor, a test) never leaves an engine or router running."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A child process with a log file, a health URL and a clean stop (SIGTERM, then SIGKILL)."""

    health_path = "/health"

    def __init__(self, host: str, port: int | None, env: dict | None = None, api_key: str | None = None):
        self.host = host
        self.port = port or find_free_port(host)
        self.env = env
        self.api_key = api_key
        self.process: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"{type(self).__name__}-{self.port}-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} must define command(): the server's command line")

    def environment(self) -> dict:
        """The child's environment: this process's, updated with ``env``."""
        return dict(os.environ, **(self.env or {}))

    def start(self) -> "ServerProcess":
        env = self.environment()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=die_with_parent)
        return self

    def last_log_lines(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=n))
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"{type(self).__name__} exited (code {code}) before becoming healthy; "
                                   f"last log lines:\n{self.last_log_lines()}")
            try:
                if httpx.get(self.url + self.health_path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{type(self).__name__} at {self.url} not healthy after {timeout}s; last log lines:\n"
                           f"{self.last_log_lines()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode

    def kill(self, timeout: float = 30.0) -> int | None:
        """SIGKILL the server's whole process group (it runs in a session of its own): the way to end a
        hung server, which a stopped (SIGSTOP) or stuck process never answers SIGTERM for."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout)
        return self.process.returncode

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

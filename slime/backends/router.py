"""Launch and drive the smg router (the SGLang model gateway, PyPI ``smg``) as a subprocess.

    router = RouterProcess(policy="consistent_hashing", worker_urls=[engine.url])
    router.start(); router.wait_healthy()
    router.add_worker(url2); router.remove_worker(url2)
    router.stop()

    with running_router("round_robin", worker_urls=[engine.url]) as router:  # started, healthy, stopped after
        ... router.url ...

The router renames its process ``smg::router``; it is stopped by PID (SIGTERM, then SIGKILL).
Workers registered through ``POST /workers`` become routable once the router's background job has
probed them; :meth:`add_worker` waits for that.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time

from slime.utils.process import ServerProcess, find_free_port


class RouterProcess(ServerProcess):
    health_path = "/liveness"
    SHUTDOWN_GRACE_SECS = 1  # unless --router-shutdown-grace-period-secs (see command())

    def __init__(self, policy: str = "cache_aware", worker_urls: list[str] | None = None, port: int | None = None,
                 host: str = "127.0.0.1", extra_args: list[str] | None = None, env: dict | None = None):
        super().__init__(host, port, env)
        self.policy = policy
        self.worker_urls = list(worker_urls or [])
        self.extra_args = list(extra_args or [])

    def command(self) -> list[str]:
        smg = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
        launcher = [smg] if os.path.exists(smg) else [sys.executable, "-m", "smg"]  # installed without scripts
        cmd = [*launcher, "launch", "--host", self.host, "--port", str(self.port), "--policy", self.policy]
        if self.worker_urls:
            cmd += ["--worker-urls", *self.worker_urls]
        # smg's Prometheus endpoint defaults to 0.0.0.0:29000: bind it like the router, on a free port,
        # so it is not exposed and two routers on one machine do not collide
        if not any(a.startswith("--prometheus-host") for a in self.extra_args):
            cmd += ["--prometheus-host", self.host]
        if not any(a.startswith("--prometheus-port") for a in self.extra_args):
            cmd += ["--prometheus-port", str(find_free_port(self.host))]
        # slime stops its router when the run ends (nothing in flight) or kills it to restart it; with
        # smg's 180 s grace period a SIGTERM'd idle router still takes ~5 s to exit, with 1 s ~0.5 s
        if not any(a.startswith("--shutdown-grace-period-secs") for a in self.extra_args):
            cmd += ["--shutdown-grace-period-secs", str(self.SHUTDOWN_GRACE_SECS)]
        return cmd + self.extra_args

    def wait_healthy(self, timeout: float = 60.0) -> None:
        super().wait_healthy(timeout)
        for url in self.worker_urls:
            self._wait_worker(url, present=True, timeout=timeout)

    def restart(self, timeout: float = 60.0) -> None:
        """Kill the router (hung or dead) and start it again on the same port with the workers it was
        launched with; returns once it is healthy and routes to them."""
        self.kill()
        self.start()
        self.wait_healthy(timeout)

    def list_workers(self) -> list[dict]:
        import httpx

        response = httpx.get(self.url + "/workers", timeout=10)
        response.raise_for_status()
        return response.json().get("workers", [])

    def add_worker(self, url: str, timeout: float = 60.0, **fields) -> None:
        import httpx

        response = httpx.post(self.url + "/workers", json={"url": url, **fields}, timeout=10)
        if response.status_code >= 400:
            raise RuntimeError(f"router refused worker {url}: {response.status_code} {response.text}")
        self._wait_worker(url, present=True, timeout=timeout)

    def remove_worker(self, url: str, timeout: float = 30.0) -> None:
        import httpx

        ids = [w["id"] for w in self.list_workers() if w.get("url") == url]
        if not ids:
            raise KeyError(f"worker {url} is not registered with the router at {self.url}")
        for worker_id in ids:
            httpx.delete(f"{self.url}/workers/{worker_id}", timeout=10).raise_for_status()
        self._wait_worker(url, present=False, timeout=timeout)

    def _wait_worker(self, url: str, present: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = [w for w in self.list_workers() if w.get("url") == url]
            ok = any(w.get("is_healthy", True) for w in workers) if present else not workers
            if ok:
                return
            time.sleep(0.2)
        raise TimeoutError(f"worker {url} {'did not appear' if present else 'was not removed'} in the router "
                           f"within {timeout}s; router log:\n{self.last_log_lines()}")


@contextlib.contextmanager
def running_router(policy: str = "cache_aware", worker_urls: list[str] | None = None, timeout: float = 60.0, **kwargs):
    """A router started for the ``with`` block, healthy and routing to every one of ``worker_urls``,
    stopped after it (also on error)."""
    router = RouterProcess(policy=policy, worker_urls=worker_urls, **kwargs)
    router.start()
    try:
        router.wait_healthy(timeout=timeout)
        yield router
    finally:
        router.stop()

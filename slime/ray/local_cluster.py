"""A multi-node Ray cluster on one machine, for trying and testing multi-node runs without a second host.

A head and worker nodes are started with ``ray start`` (one ``ray start --block`` process group per
node, so a node can be stopped alone, as when a machine fails), each with its own node IP on the
loopback network (head 127.0.0.2, workers 127.0.0.3, 127.0.0.4, ...: Linux routes all of 127/8 to
``lo``; Ray would replace 127.0.0.1 itself by the machine's address), its own logical CPU count and a custom resource ``node:<name>``; every port is picked free
and bound to loopback. Jobs are submitted through the head's job server (``ray job submit``).

    python -m slime.ray.local_cluster --temp-dir /tmp/ray-local --workers 1   # start; prints the addresses
    ray job submit --address http://127.0.0.1:<dashboard-port> -- python train.py ...
    python -m slime.ray.local_cluster --temp-dir /tmp/ray-local -- <train.py flags>  # start, submit, stop

On real machines use ``scripts/run-multinode.sh`` (``ray start`` on each host) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

__all__ = ["LocalRayCluster", "ray_cli"]

HEAD_IP = "127.0.0.2"


def ray_cli() -> str:
    """The ``ray`` command of this interpreter's environment."""
    candidate = os.path.join(os.path.dirname(sys.executable), "ray")
    return candidate if os.path.exists(candidate) else (shutil.which("ray") or "ray")


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class _Node:
    name: str
    ip: str
    process: subprocess.Popen
    log_path: str


@dataclass
class LocalRayCluster:
    """``with LocalRayCluster(temp_dir) as cluster: cluster.add_worker(); cluster.submit([...])``."""

    temp_dir: str
    head_cpus: int = 2
    env: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)  # name -> _Node
    gcs_port: int = 0
    dashboard_port: int = 0

    def __post_init__(self):
        os.makedirs(self.temp_dir, exist_ok=True)
        self._env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                     # a loopback cluster of one user: no token to hand from the head to the workers
                     "RAY_AUTH_MODE": "disabled", **self.env}
        self._env.pop("RAY_ADDRESS", None)
        self._workers_started = 0

    # ------------------------------------------------------------------ nodes

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _node_ports(self, ip: str) -> list[str]:
        ports = {name: _free_port() for name in ("node-manager-port", "object-manager-port", "metrics-export-port",
                                                 "dashboard-agent-listen-port", "runtime-env-agent-port")}
        return [arg for name, port in ports.items() for arg in (f"--{name}", str(port))]

    def _start_node(self, name: str, ip: str, cpus: int, extra: list[str]) -> _Node:
        log_path = os.path.join(self.temp_dir, f"{name}.log")
        command = [ray_cli(), "start", "--block", "--node-ip-address", ip, "--num-cpus", str(cpus),
                   "--resources", json.dumps({f"node:{name}": 1}), "--object-store-memory", str(200 * 2**20),
                   "--disable-usage-stats", *self._node_ports(ip), *extra]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                                       start_new_session=True)  # its own process group: stopped alone
        node = _Node(name, ip, process, log_path)
        self.nodes[name] = node
        return node

    def start_head(self, timeout: float = 120) -> None:
        self.gcs_port, self.dashboard_port = _free_port(), _free_port()
        self._start_node("head", HEAD_IP, self.head_cpus, [
            "--head", "--port", str(self.gcs_port), "--temp-dir", self.temp_dir, "--include-dashboard", "true",
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
            "--ray-client-server-port", str(_free_port())])
        self.wait_for_nodes(1, timeout)

    def add_worker(self, name: str, cpus: int, timeout: float = 120) -> str:
        """Start worker node ``name`` with the next loopback IP; returns that IP."""
        ip = f"127.0.0.{3 + self._workers_started}"
        self._workers_started += 1  # a replacement node gets a new address, as a new machine would
        self._start_node(name, ip, cpus, ["--address", self.address])
        self.wait_for_nodes(sum(n.process.poll() is None for n in self.nodes.values()), timeout)
        return ip

    def stop_node(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop one node with everything it runs (its process group), as a machine failure would."""
        node = self.nodes.pop(name)
        try:
            os.killpg(node.process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            node.process.wait(60)
        except subprocess.TimeoutExpired:  # a head that does not finish its graceful stop
            os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(30)

    def alive_nodes(self) -> list[dict]:
        """The cluster's live nodes as the head's job server reports them."""
        import httpx

        response = httpx.get(f"{self.dashboard_url}/nodes?view=summary", timeout=30)
        response.raise_for_status()
        summary = response.json()["data"]["summary"]
        return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]

    def wait_for_nodes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_error = None
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                if node.process.poll() is not None:
                    raise RuntimeError(f"ray node {node.name} exited ({node.process.returncode}); see {node.log_path}")
            try:
                if len(self.alive_nodes()) >= count:
                    return
            except Exception as e:  # the job server is not up yet
                last_error = e
            time.sleep(1)
        raise TimeoutError(f"{count} Ray nodes did not come up within {timeout} s (last error: {last_error}); "
                           f"logs in {self.temp_dir}")

    # ------------------------------------------------------------------ jobs

    def submit_command(self, entrypoint: list[str], cwd: str, env: dict | None = None, wait: bool = True,
                       submission_id: str | None = None) -> list[str]:
        """The ``ray job submit`` command running ``entrypoint`` in ``cwd`` on the head."""
        command = [ray_cli(), "job", "submit", "--address", self.dashboard_url, "--entrypoint-num-cpus", "0"]
        if not wait:
            command.append("--no-wait")
        if submission_id:
            command += ["--submission-id", submission_id]
        if env:
            command += ["--runtime-env-json", json.dumps({"env_vars": {k: str(v) for k, v in env.items()}})]
        return command + ["--", "bash", "-c", f"cd {_quote(cwd)} && exec " + " ".join(_quote(a) for a in entrypoint)]

    def submit_no_wait(self, entrypoint: list[str], cwd: str, submission_id: str, env: dict | None = None) -> None:
        """``ray job submit --no-wait``: the job runs on; follow it with :meth:`job_status` / :meth:`job_logs`."""
        subprocess.run(self.submit_command(entrypoint, cwd, env, wait=False, submission_id=submission_id),
                       env=self._env, capture_output=True, text=True, timeout=300, check=True)

    def job_status(self, submission_id: str) -> str:
        import httpx

        response = httpx.get(f"{self.dashboard_url}/api/jobs/{submission_id}", timeout=30)
        response.raise_for_status()
        return response.json()["status"]

    def job_logs(self, submission_id: str) -> str:
        import httpx

        response = httpx.get(f"{self.dashboard_url}/api/jobs/{submission_id}/logs", timeout=30)
        response.raise_for_status()
        return response.json()["logs"]

    def wait_job(self, submission_id: str, timeout: float) -> str:
        """Wait until the job ends (SUCCEEDED, FAILED or STOPPED); returns that status."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.job_status(submission_id)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            time.sleep(2)
        raise TimeoutError(f"job {submission_id} still running after {timeout} s")

    def stop_job(self, submission_id: str) -> None:
        subprocess.run([ray_cli(), "job", "stop", "--address", self.dashboard_url, submission_id], env=self._env,
                       capture_output=True, timeout=120)

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Workers first, then the head."""
        for name in [n for n in self.nodes if n != "head"] + (["head"] if "head" in self.nodes else []):
            self.stop_node(name, signal.SIGTERM if name == "head" else signal.SIGKILL)

    def __enter__(self) -> "LocalRayCluster":
        try:
            self.start_head()
        except BaseException:
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(str(text))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start a head and worker Ray nodes on this machine (loopback IPs); "
                                                 "Ctrl-C stops them.")
    parser.add_argument("--temp-dir", required=True, help="Ray's session directory and the node logs")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--head-cpus", type=int, default=2)
    parser.add_argument("--worker-cpus", type=int, default=2)
    argv = list(sys.argv[1:] if argv is None else argv)
    train_flags = argv[argv.index("--") + 1:] if "--" in argv else None
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    with LocalRayCluster(args.temp_dir, head_cpus=args.head_cpus) as cluster:
        for i in range(args.workers):
            cluster.add_worker(f"worker{i + 1}", args.worker_cpus)
        print(json.dumps({"address": cluster.address, "dashboard": cluster.dashboard_url,
                          "nodes": {n.name: n.ip for n in cluster.nodes.values()}}), flush=True)
        if train_flags is not None:  # submit train.py, stream its logs, stop the cluster
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            command = cluster.submit_command([sys.executable, "train.py", *train_flags], root,
                                             env={"PYTHONPATH": os.environ.get("PYTHONPATH", root)})
            result = subprocess.run(command, env=cluster._env)
            sys.exit(result.returncode)
        try:
            while all(n.process.poll() is None for n in cluster.nodes.values()):
                time.sleep(1)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()

"""The rollout health monitor against real sockets: an engine that answers, one that hangs (accepts
connections, never answers: what a SIGSTOPped process does), one that is gone. The real loop with a
SIGSTOPped engine is tests/ray/test_loop.py::test_hung_then_dead_engine_is_restarted_given_current_weights."""

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime.ray.engine_health import EngineHealthMonitor, probe
from slime.arguments import parse_args


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def healthy_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health_generate"
    server.shutdown()
    server.server_close()


@pytest.fixture
def hung_url():
    """A listening socket nobody accepts from: connects succeed (the kernel's backlog), answers never come."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/health_generate"
    sock.close()


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/health_generate"


def test_probe_tells_healthy_hung_and_dead_apart(healthy_url, hung_url):
    assert probe(healthy_url, 2.0) is None
    start = time.monotonic()
    assert "hung" in probe(hung_url, 0.5)
    assert time.monotonic() - start < 2.0  # detected at the timeout, not at the HTTP client's default
    assert "dead" in probe(_dead_url(), 0.5)


def test_hung_engine_is_recovered_within_interval_plus_timeout(healthy_url, hung_url):
    urls = [healthy_url, hung_url]
    recovered = []

    def recover(index, reason):
        recovered.append((index, reason, time.monotonic()))
        urls[index] = healthy_url  # "restarted"

    monitor = EngineHealthMonitor(lambda: list(urls), recover, interval=0.2, timeout=0.5)
    start = time.monotonic()
    monitor.start()
    time.sleep(1.5)
    monitor.stop()
    assert [(i, "hung" in why) for i, why, _ in recovered] == [(1, True)]  # once: it answers after the restart
    assert recovered[0][2] - start < 0.2 + 0.5 + 1.0  # one interval + the probe timeout (+ scheduling slack)
    assert monitor.recovered == [(1, recovered[0][1])]


def test_first_wait_defers_probes_and_a_failed_recovery_is_raised(hung_url):
    calls = []

    def recover(index, reason):
        calls.append(time.monotonic())
        raise OSError("no devices left")

    monitor = EngineHealthMonitor(lambda: [hung_url], recover, interval=0.1, timeout=0.2, first_wait=0.8)
    monitor.mark_up(0)
    start = time.monotonic()
    monitor.start()
    time.sleep(1.5)
    with pytest.raises(RuntimeError, match="could not recover a failed engine or router: no devices left"):
        monitor.stop()
    assert len(calls) == 1 and calls[0] - start >= 0.8  # not probed during the grace period; stopped after the failure


def test_health_check_flags_need_fault_tolerance():
    base = ["--rollout-batch-size", "4", "--num-rollout", "2", "--train-backend", "fsdp", "--rollout-backend", "embedded"]
    with pytest.raises(ValueError, match="--rollout-health-check-interval 5.0.*--use-fault-tolerance"):
        parse_args(base + ["--rollout-health-check-interval", "5"])
    with pytest.raises(ValueError, match="--rollout-health-check-timeout"):
        parse_args(base + ["--use-fault-tolerance", "--rollout-health-check-timeout", "0"])
    args = parse_args(base + ["--use-fault-tolerance", "--rollout-health-check-interval", "5",
                              "--rollout-health-check-first-wait", "60"])
    assert args.rollout_health_check_interval == 5.0 and args.rollout_health_check_first_wait == 60.0

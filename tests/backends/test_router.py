"""The real smg router in front of the embedded engine: registration, routing, routing keys."""

from __future__ import annotations

import httpx
import pytest

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.backends.router import running_router

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with running_engine(tiny_model_dir, extra_args=["--context-length", "256"]) as proc:
        yield proc


def _generate(url, headers=None):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    response = httpx.post(url + "/generate", json=body, headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_router_with_worker_urls_and_consistent_hashing(engine):
    direct = _generate(engine.url)
    with running_router("consistent_hashing", worker_urls=[engine.url]) as router:
        routed = _generate(router.url, headers={"X-SMG-Routing-Key": "session-1"})
        assert routed["output_ids"] == direct["output_ids"]
        assert routed["meta_info"]["output_token_logprobs"] == direct["meta_info"]["output_token_logprobs"]
        assert [w["url"] for w in router.list_workers()] == [engine.url]
    assert router.process.poll() is not None  # stopped when the block ends


def test_router_register_and_remove_worker(engine):
    with running_router("round_robin") as router:
        router.add_worker(engine.url)
        assert len(_generate(router.url)["output_ids"]) == 4
        router.remove_worker(engine.url)
        assert router.list_workers() == []


def test_router_command_shortens_smgs_shutdown_grace_unless_given():
    """slime stops its own router when a run ends (nothing in flight): smg's 180 s grace period kept an
    idle router ~5 s in SIGTERM, 1 s ~0.5 s. A user's --router-shutdown-grace-period-secs wins."""
    from slime.backends.router import RouterProcess

    default = RouterProcess(policy="round_robin").command()
    assert default[default.index("--shutdown-grace-period-secs") + 1] == "1"
    given = RouterProcess(policy="round_robin", extra_args=["--shutdown-grace-period-secs", "30"]).command()
    assert given.count("--shutdown-grace-period-secs") == 1
    assert given[given.index("--shutdown-grace-period-secs") + 1] == "30"

"""``generate_rollout`` against the embedded engine behind the real smg router, on the tiny model.

Rewards (random rule RM), dynamic sampling (nonzero-std filter) and partial rollout are on; with
four groups drawn per round and only two requests in flight, the abort always leaves unfinished
groups, which go back to the buffer and are continued in the next step.
"""

import json
import math

import pytest

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.backends.router import running_router
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.metrics import compute_rollout_metrics
from slime.rollout.sglang_rollout import generate_rollout
from slime.arguments import parse_args
from slime.utils.types import Sample

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture(scope="module")
def served_model(tiny_model_dir):
    with running_engine(tiny_model_dir, extra_args=["--context-length", "256"]) as engine:
        with running_router("consistent_hashing", worker_urls=[engine.url]) as router:
            yield engine, router


def _check_sample(sample: Sample):
    assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    assert sample.response_length > 0 and len(sample.tokens) > sample.response_length
    assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in sample.rollout_log_probs)
    assert sample.reward in (0, 1) and sample.weight_versions


@pytest.mark.parametrize("generator", [None, "slime.rollout.sglang_streaming_rollout.generate_streaming"],
                         ids=["default", "streaming"])
def test_generate_rollout_end_to_end(served_model, tiny_model_dir, tmp_path, generator):
    """The default generator (groups batched into one request) and the streaming one (server-sent events through
    the router, one request a sample): both leave aborted partial samples that the next step continues."""
    engine, router = served_model
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}], "label": str(i)} for i in range(24)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", tiny_model_dir,
        "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "8",
        "--num-rollout", "2", "--rollout-max-response-len", "48", "--rollout-temperature", "1.0",
        "--rm-type", "random", "--partial-rollout", "--router-policy", "consistent_hashing",
        "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--sglang-server-concurrency", "2",
        "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
        *(["--custom-generate-function-path", generator] if generator else []),
    ])  # fmt: skip
    args.rollout_engine_urls = [engine.url]
    source = RolloutDataSourceWithBuffer(args)

    first = generate_rollout(args, 0, source)
    assert len(first.samples) == 2 and all(len(group) == 4 for group in first.samples)
    for group in first.samples:
        for sample in group:
            _check_sample(sample)
        assert len({s.reward for s in group}) > 1  # the filter kept only groups with signal
    assert source.get_buffer_length() > 0  # unfinished groups recycled
    recycled = [s for g in source.buffer for s in g]
    assert any(s.status == Sample.Status.ABORTED for s in recycled)
    partial = {s.index: (list(s.tokens), s.response_length) for s in recycled if s.response_length > 0}
    assert all(s.metadata["start_rollout_id"] == 0 for s in recycled if s.response_length > 0)

    second = generate_rollout(args, 1, source)
    assert len(second.samples) == 2 and all(len(group) == 4 for group in second.samples)
    for sample in (s for g in second.samples for s in g):
        _check_sample(sample)
        if sample.index in partial:  # continued: the earlier tokens are kept as a prefix
            tokens, earlier = partial[sample.index]
            assert sample.tokens[: len(tokens)] == tokens and sample.response_length >= earlier
            assert sample.metadata["start_rollout_id"] == 0
    continued = [s.index for g in second.samples for s in g if s.index in partial]
    print(f"partial samples recycled: {len(partial)}; continued and kept in step 1: {continued}")
    metrics = compute_rollout_metrics(args, [s for g in second.samples for s in g], rollout_time=1.0)
    assert metrics["rollout/response_len/max"] > 0


_router_to_kill = {}


async def generate_and_kill_router_once(args, sample, sampling_params):
    """The default generate, except that the 5th call first SIGKILLs the router (its in-flight
    requests are lost with it)."""
    from slime.rollout.sglang_rollout import generate

    _router_to_kill["calls"] = _router_to_kill.get("calls", 0) + 1
    if _router_to_kill["calls"] == 5:
        _router_to_kill["router"].process.kill()
    return await generate(args, sample, sampling_params)


def test_router_killed_mid_rollout_is_restarted_and_nothing_is_lost(served_model, tiny_model_dir, tmp_path):
    """The router dies in the middle of a step; the health monitor (as the rollout manager runs it
    with --use-fault-tolerance) restarts it on its port with its engine, the default generate retries
    the requests that failed meanwhile, and the step has every group whole, each sample once."""
    from slime.backends.router import RouterProcess
    from slime.ray.engine_health import ROUTER_PROBE_PATH, EngineHealthMonitor

    engine, _ = served_model
    router = RouterProcess("round_robin", worker_urls=[engine.url])
    router.start()
    try:
        router.wait_healthy(timeout=60)
        _router_to_kill.update(router=router, calls=0)
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("\n".join(json.dumps({"prompt": f"Count to {i}.", "label": str(i)}) for i in range(8)) + "\n")
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", tiny_model_dir,
            "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "1",
            "--rollout-max-response-len", "16", "--rm-type", "random", "--use-fault-tolerance",
            "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "2",
            "--custom-generate-function-path", "tests.rollout.test_rollout_integration.generate_and_kill_router_once",
            "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
        ])  # fmt: skip
        args.rollout_engine_urls = [engine.url]
        restarts = []
        monitor = EngineHealthMonitor(lambda: [router.url + ROUTER_PROBE_PATH],
                                      lambda i, why: (restarts.append(why), router.restart(timeout=60)),
                                      interval=args.rollout_health_check_interval,
                                      timeout=args.rollout_health_check_timeout)
        monitor.start()
        try:
            out = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
        finally:
            monitor.stop()
        assert len(restarts) == 1 and "dead" in restarts[0]
        assert len(out.samples) == 4 and all(len(group) == 4 for group in out.samples)
        leaves = [s for group in out.samples for s in group]
        assert sorted(s.index for s in leaves) == list(range(16))
        for sample in leaves:
            _check_sample(sample)
    finally:
        router.stop()

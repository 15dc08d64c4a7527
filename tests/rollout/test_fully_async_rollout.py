"""The fully asynchronous rollout against the embedded engine behind the real smg router (tiny model).

What a user relies on: a step hands over exactly ``--rollout-batch-size`` completed groups; the
worker goes on generating between steps (nobody calls the rollout function); after the engines'
weight version moves on, groups older than ``--max-weight-staleness`` versions are dropped and the
step is filled with groups of the new version.
"""

import json
import time

import httpx
import pytest

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.backends.router import running_router
from slime.rollout import fully_async_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.arguments import parse_args
from slime.utils.types import Sample

pytestmark = [pytest.mark.timeout(240)]


def _args(model_dir, prompts, router, engine, *extra):
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
        "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "3",
        "--rollout-max-response-len", "6", "--rm-type", "random", "--sglang-server-concurrency", "4",
        "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port), *extra,
    ])  # fmt: skip
    args.rollout_engine_urls = [engine.url]
    return args


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with running_engine(tiny_model_dir, extra_args=["--context-length", "256"]) as engine, \
            running_router("round_robin", worker_urls=[engine.url]) as router:
        yield engine, router


def _set_version(engine, version):
    httpx.post(f"{engine.url}/update_weight_version", json={"new_version": str(version)}, timeout=30).raise_for_status()


def _versions(group):
    return {int(v) for s in group for v in s.weight_versions}


def test_background_generation_and_staleness_drop(served, tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Count to {i}."}], "label": str(i)} for i in range(40)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    engine, router = served
    _set_version(engine, 0)
    args = _args(tiny_model_dir, prompts, router, engine, "--max-weight-staleness", "1")
    source = RolloutDataSourceWithBuffer(args)
    try:
        first = fully_async_rollout.generate_rollout_fully_async(args, 0, source)
        assert len(first.samples) == 2 and all(len(g) == 2 for g in first.samples)
        indices = [g[0].index for g in first.samples]
        assert indices == sorted(indices)
        for sample in (s for g in first.samples for s in g):
            assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
            assert sample.reward in (0, 1) and sample.weight_versions == ["0"]
            assert len(sample.rollout_log_probs) == sample.response_length > 0
        assert first.metrics["rollout/fully_async/staleness_max"] == 0

        # nobody asks for a step, yet the next step's groups are generated
        worker = fully_async_rollout.get_worker(args, source)
        deadline = time.monotonic() + 60
        while len(worker.completed) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(worker.completed) >= 2, "the worker did not generate between steps"
        waiting = [g[0].index for g in worker.completed]

        # the policy moves on by 3 versions: everything generated at version 0 is too old (> 1)
        _set_version(engine, 3)
        second = fully_async_rollout.generate_rollout_fully_async(args, 1, source)
        assert second.metrics["rollout/fully_async/dropped_stale_groups"] >= len(waiting)
        assert len(second.samples) == 2
        for group in second.samples:
            assert group[0].index not in waiting
            assert _versions(group) == {3}  # continued-after-abort groups held 0 and 3: dropped too
        assert second.metrics["rollout/fully_async/staleness_max"] == 0
        assert len({s.index for g in first.samples + second.samples for s in g}) == 8  # no group twice
    finally:
        fully_async_rollout.stop_worker()


def test_keeps_stale_groups_without_a_bound_and_refuses_colocate_and_eval(served, tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "label": str(i)} for i in range(20)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    engine, router = served
    _set_version(engine, 0)
    args = _args(tiny_model_dir, prompts, router, engine)
    source = RolloutDataSourceWithBuffer(args)
    try:
        fully_async_rollout.generate_rollout_fully_async(args, 0, source)
        worker = fully_async_rollout.get_worker(args, source)
        deadline = time.monotonic() + 60
        while len(worker.completed) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        _set_version(engine, 5)
        second = fully_async_rollout.generate_rollout_fully_async(args, 1, source)
        assert second.metrics["rollout/fully_async/dropped_stale_groups"] == 0
        assert second.metrics["rollout/fully_async/staleness_max"] == 5  # kept, and reported as 5 behind
        with pytest.raises(ValueError, match="does not evaluate"):
            fully_async_rollout.generate_rollout_fully_async(args, 1, source, evaluation=True)
        args.colocate = True
        with pytest.raises(ValueError, match="--colocate"):
            fully_async_rollout.generate_rollout_fully_async(args, 2, source)
    finally:
        fully_async_rollout.stop_worker()

"""--profile-target rollout: the engines profiled during one rollout step's generation, traces in the run
directory (the embedded engine on CPU, which serves SGLang's /start_profile and /stop_profile)."""

import json
from types import SimpleNamespace

import httpx
import pytest

from slime.backends.embedded_engine.serving.launch import running_engine
from slime.observability.profiling import profile_rollout

pytestmark = pytest.mark.timeout(120)


def _args(run_dir, targets=("rollout",), start=1, end=2):
    return SimpleNamespace(use_pytorch_profiler=True, profile_target=list(targets), profile_step_start=start,
                           profile_step_end=end, run_dir=str(run_dir))


def _generate(url):
    response = httpx.post(url + "/generate", timeout=60, json={
        "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert response.status_code == 200, response.text


def test_rollout_target_profiles_the_engines_of_the_chosen_steps(tiny_model_dir, tmp_path):
    args = _args(tmp_path)
    with running_engine(tiny_model_dir, extra_args=["--context-length", "128"]) as engine:
        for rollout_id in range(3):
            with profile_rollout(args, rollout_id, [engine.url]):
                _generate(engine.url)
        with profile_rollout(_args(tmp_path / "train_only", targets=("train",)), 1, [engine.url]):
            _generate(engine.url)
    files = sorted(p.name for p in (tmp_path / "profile" / "rollout").glob("*.trace.json"))
    assert files == ["rollout_1-engine0-generate-TP-0.trace.json"]  # step 1 only
    with open(tmp_path / "profile" / "rollout" / files[0]) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert "engine_prefill" in names and "engine_decode" in names
    assert not (tmp_path / "train_only" / "profile").exists()  # the rollout side is profiled only when chosen

"""train.py end to end on the tiny model (CPU engine, FSDP trainer) with a reward that cannot work: the run
stops with one message instead of "succeeding" on nothing, and a SIGTERM while a reward hangs stops it in
seconds (not the three minutes the rollout side used to be waited for), leaving no process behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ray.test_shutdown import _processes_mentioning

REPO = Path(__file__).parents[2]
pytestmark = pytest.mark.slow


def _command(model_dir, data, run_dir, reward, *extra):
    return [sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--rollout-backend", "embedded",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--hf-checkpoint", str(model_dir),
            "--prompt-data", data, "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", reward, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-rollout", "3", "--run-dir", str(run_dir), *extra]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "ray"), str(REPO)]),
               TOKENIZERS_PARALLELISM="false", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", **extra)
    env.pop("SLIME_DEBUG", None)
    return env


@pytest.mark.timeout(300)
def test_every_reward_failing_stops_the_run_with_the_reason(tiny_model_dir, tiny_task_data, tmp_path):
    save = tmp_path / "ckpt"
    result = subprocess.run(_command(tiny_model_dir, tiny_task_data["train"], tmp_path / "run",
                                     "mistake_plugins.raising_reward", "--save", str(save), "--save-interval", "1"),
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=280)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("slime: error: rollout step 0: 4 of 4 samples FAILED"), last
    assert "reward_error: KeyError: 'answer'" in last[0]
    assert not (save / "latest_checkpointed_iteration.txt").exists()  # nothing trained, nothing saved


@pytest.mark.timeout(300)
def test_sigterm_while_a_reward_hangs_stops_within_seconds(tiny_model_dir, tiny_task_data, tmp_path):
    model_dir = tmp_path / "model"  # a private copy: leftover processes are attributable to this run
    import shutil

    shutil.copytree(tiny_model_dir, model_dir)
    started = tmp_path / "reward_started"
    process = subprocess.Popen(_command(model_dir, tiny_task_data["train"], tmp_path / "run",
                                        "mistake_plugins.hanging_reward"),
                               cwd=tmp_path, env=_env(SLIME_TEST_REWARD_STARTED=str(started)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not started.exists():
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the reward was never called"
            time.sleep(0.5)
        time.sleep(1)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        stop_seconds = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
    assert stop_seconds < 20, f"SIGTERM took {stop_seconds:.1f} s"
    time.sleep(2)
    assert _processes_mentioning(str(model_dir)) == [], "an engine process outlived the run"

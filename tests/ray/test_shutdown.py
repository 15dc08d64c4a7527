"""A training run stopped with SIGTERM (what schedulers and `kill` send) shuts down in order and
leaves no engine, router or Ray process behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(pid))
    return found


@pytest.mark.timeout(300)
def test_sigterm_stops_everything(tiny_model_dir, tiny_task_data, tmp_path):
    run_dir = tmp_path / "run"
    model_dir = tmp_path / "model"  # a private copy, so that leftovers are attributable to this run
    import shutil

    shutil.copytree(tiny_model_dir, model_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "ray"), str(REPO)]),
               TOKENIZERS_PARALLELISM="false", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    command = [sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--rollout-backend", "embedded",
               "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--hf-checkpoint", str(model_dir),
               "--prompt-data", tiny_task_data["train"], "--input-key", "prompt", "--label-key", "label",
               "--apply-chat-template", "--custom-rm-path", "loop_plugins.even_first_token_reward",
               "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
               "--num-rollout", "1000", "--run-dir", str(run_dir)]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").stat().st_size == 0:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the run produced no metrics in time"
            time.sleep(1)
        assert _processes_mentioning(str(model_dir)), "the engine should be running"
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    finally:
        if process.poll() is None:
            process.kill()
    time.sleep(2)
    assert _processes_mentioning(str(model_dir)) == [], "an engine process outlived the run"
    assert _processes_mentioning(str(run_dir)) == [], "a process of the run outlived it"

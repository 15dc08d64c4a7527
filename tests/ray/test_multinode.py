"""A real two-node Ray cluster on this machine (``ray start`` head and worker, each its own loopback
node IP): ``train.py`` submitted with ``ray job submit``, its training ranks on both nodes (gloo across
them), engines and the rollout manager wherever the rest fits, weights pushed from the trainer to every
engine each step; the worker node is then killed mid-run and the run resumed from its checkpoint on a
new worker node.

Takes minutes on two cores (two Ray nodes, two jobs), so it runs only with ``SLIME_TEST_MULTINODE=1``
(``scripts/run-multinode-cpu.sh`` runs the same scenario by hand; ``.ci/run`` runs this test as a step of
its own after the suite).
"""

import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from slime.ray.local_cluster import LocalRayCluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(os.environ.get("SLIME_TEST_MULTINODE") != "1",
                                 reason="minutes on 2 cores; set SLIME_TEST_MULTINODE=1"),
              # `ray job submit` needs the head's job server: the `cluster` extra (ray[default]), kept out of
              # `dev` because its dashboard agent starts with every ray.init of the suite
              pytest.mark.skipif(importlib.util.find_spec("aiohttp_cors") is None,
                                 reason="needs ray[default]: pip install -e '.[cluster]'")]


def _train_command(model_dir, data, out, steps):
    return [str(ROOT / ".venv" / "bin" / "python"), "train.py",
            "--train-backend", "fsdp", "--rollout-backend", "embedded",
            "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
            "--hf-checkpoint", model_dir, "--prompt-data", data["train"], "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--custom-rm-path", "loop_plugins.even_token_fraction_reward",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
            "--num-rollout", str(steps), "--num-steps-per-rollout", "1", "--lr", "1e-2", "--seed", "1",
            "--save", str(out / "ckpt"), "--load", str(out / "ckpt"), "--save-interval", "2",
            "--check-weight-update-equal", "--run-dir", str(out / "run"), "--console-log-interval", "1"]


def _placement(logs):
    match = re.search(r"placement on (\d+) Ray node\(s\): actor ranks on \[(.*?)\]; engines at \[(.*?)\]", logs)
    assert match, logs[-3000:]
    ranks = [ip.strip(" '") for ip in match.group(2).split(",")]
    return int(match.group(1)), ranks


def test_two_nodes_job_submit_kill_worker_and_resume(tiny_model_dir, tiny_task_data, tmp_path, request):
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'ray'}{os.pathsep}{ROOT}", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path
    ray_dir = tempfile.mkdtemp(prefix="slime-ray-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(ray_dir, ignore_errors=True))
    with LocalRayCluster(ray_dir, head_cpus=3) as cluster:
        worker_ip = cluster.add_worker("worker1", cpus=2)
        cluster.submit_no_wait(_train_command(tiny_model_dir, tiny_task_data, out, steps=8), str(ROOT), "first", env)
        checkpoint = out / "ckpt" / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + 600
        while not checkpoint.exists():
            assert cluster.job_status("first") in ("PENDING", "RUNNING"), cluster.job_logs("first")[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(1)
        nodes, ranks = _placement(cluster.job_logs("first"))
        assert nodes == 2 and worker_ip in ranks and len(set(ranks)) == 2  # one training rank per node
        cluster.stop_node("worker1")  # the worker machine fails mid-run
        status = None
        try:
            status = cluster.wait_job("first", timeout=180)
        except TimeoutError:  # a rank blocked in a collective with the dead one: stop the job as a user would
            cluster.stop_job("first")
            status = cluster.wait_job("first", timeout=120)
        assert status in ("FAILED", "STOPPED"), status
        saved = int(checkpoint.read_text().strip())
        assert saved < 8

        new_ip = cluster.add_worker("worker2", cpus=2)  # a replacement machine
        cluster.submit_no_wait(_train_command(tiny_model_dir, tiny_task_data, out, steps=8), str(ROOT), "resumed", env)
        status = cluster.wait_job("resumed", timeout=900)
        logs = cluster.job_logs("resumed")
        assert status == "SUCCEEDED", logs[-5000:]
        nodes, ranks = _placement(logs)
        assert nodes == 2 and new_ip in ranks and len(set(ranks)) == 2
        assert "--check-weight-update-equal: engine weights equal the trainer's" in logs

    records = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    trained = [r["step"] for r in records if r["kind"] == "train"]
    assert trained[-(7 - saved):] == list(range(saved + 1, 8))  # the resumed job ran the steps after the checkpoint
    assert trained.count(0) == 1  # and did not start over
    syncs = [r["perf/update_weights_bytes"] for r in records if r["kind"] == "perf" and "perf/update_weights_bytes" in r]
    assert syncs and all(b > 0 for b in syncs)  # weights went to the engines every step, across the nodes

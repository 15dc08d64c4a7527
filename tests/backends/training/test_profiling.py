"""--use-pytorch-profiler / --profile-target on the trainer (CPU, FSDP2 on gloo, the tiny model) and the
start-up checks of the profiling and memory-history flags."""

import json
import os

import pytest
import torch

from slime.backends.training.worker import TrainWorker
from tests.backends.fsdp_utils.fsdp_test_utils import make_args, make_samples, rank_data

pytestmark = pytest.mark.usefixtures("single_rank")


def _trace_event_names(path) -> set[str]:
    with open(path) as f:
        trace = json.load(f)  # a Chrome trace: what chrome://tracing and Perfetto open
    return {event.get("name", "") for event in trace["traceEvents"]}


def test_profiled_train_step_writes_a_trace_of_its_ops(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--run-dir", str(tmp_path),
                     "--profile-target", "train_overall", "train_actor", "--profile-step-start", "1",
                     "--profile-step-end", "2")
    assert args.use_pytorch_profiler  # --profile-target alone turns it on
    worker = TrainWorker(args)
    worker.init()
    data = rank_data(args, make_samples(4))
    for rollout_id in range(2):
        worker.train(rollout_id, data)

    profile_dir = tmp_path / "profile"
    traces = sorted(p.name for p in profile_dir.glob("*.trace.json"))
    # only step 1 is profiled; train_actor runs inside train_overall, so it is a labelled span of that trace
    assert traces == ["actor-train_overall-rollout_1-rank0.trace.json"]
    names = _trace_event_names(profile_dir / traces[0])
    assert {"slime/train_overall", "slime/train_actor"} <= names
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") or n == "aten::linear" for n in names)
    assert any("backward" in n.lower() for n in names)  # the backward pass of the step is in it
    assert any(n.startswith("Optimizer.step") for n in names)
    ops_table = (profile_dir / "actor-train_overall-rollout_1-rank0.ops.txt").read_text()
    assert "aten::" in ops_table


def test_inner_target_alone_gets_its_own_trace(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "2", "--run-dir", str(tmp_path),
                     "--profile-target", "train_log_probs", "--profile-step-start", "0", "--profile-step-end", "1")
    worker = TrainWorker(args)
    worker.init()
    worker.train(0, rank_data(args, make_samples(4)))
    traces = [p.name for p in (tmp_path / "profile").glob("*.trace.json")]
    assert traces == ["actor-train_log_probs-rollout_0-rank0.trace.json"]
    names = _trace_event_names(tmp_path / "profile" / traces[0])
    assert "slime/train_log_probs" in names and "slime/train_actor" not in names
    assert not any(n.startswith("Optimizer.step") for n in names)  # forward-only: no optimizer in it


def test_profile_step_range_outside_the_run_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="--profile-step-start 10 is outside"):
        make_args(tiny_model_dir, "--use-pytorch-profiler")  # default start 10, --num-rollout 4
    with pytest.raises(ValueError, match="--profile-step-end"):
        make_args(tiny_model_dir, "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_memory_history_is_refused_without_cuda(tiny_model_dir):
    with pytest.raises(ValueError, match="--record-memory-history .*needs a GPU"):
        make_args(tiny_model_dir, "--record-memory-history")


def test_memray_recorder_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="--memory-recorder 'memray'"):
        make_args(tiny_model_dir, "--memory-recorder", "memray")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_history_snapshot_after_n_steps(tiny_model_dir, tmp_path):
    import pickle

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--run-dir", str(tmp_path),
                     "--record-memory-history", "--memory-snapshot-num-steps", "2")
    worker = TrainWorker(args)
    worker.init()
    data = rank_data(args, make_samples(4))
    for rollout_id in range(3):
        worker.train(rollout_id, data)
    snapshots = sorted(os.listdir(tmp_path / "memory"))
    assert snapshots == ["actor-rollout_1-rank0.pickle"]  # once, after the second step
    with open(tmp_path / "memory" / snapshots[0], "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])

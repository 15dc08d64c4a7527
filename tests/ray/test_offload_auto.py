"""Colocated offloading decided by measurement: with neither offload flag given, the loop offloads
until the first training step has shown that trainer and engines fit on the device together, then
keeps both resident; an explicit flag is always obeyed."""

import pytest

import slime.ray.job as job_module
from slime.ray.job import Job
from slime.arguments import parse_args

GiB = 2**30
BASE = ["--rollout-batch-size", "4", "--num-rollout", "4", "--train-backend", "fsdp", "--rollout-backend", "embedded",
        "--colocate", "--actor-num-gpus-per-node", "1"]


@pytest.mark.parametrize("extra, auto", [([], True), (["--offload-train"], False), (["--no-offload-rollout"], False),
                                         (["--offload"], False)])
def test_auto_only_when_no_offload_flag_is_given(extra, auto):
    args = parse_args(BASE + extra)
    assert args.offload_auto is auto
    assert args.offload_train is True and args.offload_rollout is (extra != ["--no-offload-rollout"])


def test_not_colocated_is_never_auto():
    args = parse_args([a for a in BASE if a != "--colocate"])
    assert args.offload_auto is False and args.offload_train is False


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeRolloutManager:
    def __init__(self, calls):
        self.offload = _Remote(lambda: calls.append("engine release"))
        self.onload = _Remote(lambda tags=None: calls.append(f"engine resume {tags}"))


class FakeActor:
    """The actor TrainGroup: device memory as the engines and the trainer would hold it."""

    def __init__(self, calls, engines_used: float, trainer_peak: float, total: float = 141 * GiB):
        self.calls, self.engines_used, self.trainer_peak, self.total = calls, engines_used, trainer_peak, total
        self.resident = False

    def device_memory(self):
        used = self.engines_used + (self.trainer_peak if self.resident else 1 * GiB)
        return [{"total": self.total, "used": used, "peak_reserved": self.trainer_peak}]

    def offload(self):
        self.resident = False
        self.calls.append("trainer offload")

    def begin_offload(self):
        self.calls.append("trainer starts moving its optimizer state")

    def onload(self):
        self.resident = True
        self.calls.append("trainer onload")

    def train(self, rollout_id, data_refs, extras):
        self.calls.append("train")
        return {}

    def release_cached_memory(self):
        self.calls.append("trainer returns cached blocks")

    def update_weights(self, version):
        # the push reads the trainer's parameters where they are: on the device they go device to device
        self.calls.append("push weights" if self.resident else "push weights from host")
        return {}


def run_steps(monkeypatch, extra, engines_used, trainer_peak, steps=3):
    monkeypatch.setattr(job_module.ray, "get", lambda value, **kwargs: value)
    args = parse_args(BASE + extra)
    job = Job(args)
    calls: list[str] = []
    job.actor = FakeActor(calls, engines_used, trainer_peak)
    job.rollout_manager = FakeRolloutManager(calls)
    job.update_weights()  # the first sync, before any training
    per_step = []
    for rollout_id in range(steps):
        start = len(calls)
        job.train(rollout_id, [])
        job.update_weights()
        per_step.append(calls[start:])
    return args, per_step


def test_fitting_run_stops_offloading_after_the_first_step(monkeypatch):
    args, steps = run_steps(monkeypatch, [], engines_used=40 * GiB, trainer_peak=60 * GiB)
    # step 0 ran offloaded (and measured); the weights went to engines that were resumed, the trainer stayed
    assert steps[0] == ["engine release", "trainer onload", "train", "engine resume ['weights']", "push weights",
                        "engine resume ['kv_cache']"]
    assert steps[1] == steps[2] == ["train", "push weights"]
    assert args.offload_train is False and args.offload_rollout is False and args.offload_auto is False


def test_run_that_does_not_fit_keeps_offloading(monkeypatch):
    args, steps = run_steps(monkeypatch, [], engines_used=70 * GiB, trainer_peak=70 * GiB)
    # the weights leave the trainer's device memory (CUDA IPC) before the trainer goes to the host; its optimizer
    # state (which the push does not read) starts for the host before the push
    full = ["engine release", "trainer onload", "train", "trainer returns cached blocks",
            "trainer starts moving its optimizer state", "engine resume ['weights']", "push weights", "trainer offload",
            "engine resume ['kv_cache']"]
    assert steps == [full, full, full]
    assert args.offload_train is True and args.offload_auto is False


def test_explicit_offload_flag_is_obeyed_even_when_it_fits(monkeypatch):
    args, steps = run_steps(monkeypatch, ["--offload-train", "--offload-rollout"], engines_used=10 * GiB, trainer_peak=10 * GiB)
    assert all("trainer offload" in step and "engine release" in step for step in steps)

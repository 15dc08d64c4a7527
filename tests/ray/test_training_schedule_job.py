"""--num-critic-only-steps: with a critic (PPO), the first N rollout steps train the critic alone; the
actor joins at step N, on the values the critic computed for that step."""

import slime.ray.job as job_module
from slime.ray.job import Job
from slime.arguments import parse_args

BASE = ["--rollout-batch-size", "4", "--num-rollout", "4", "--train-backend", "fsdp", "--rollout-backend", "embedded",
        "--advantage-estimator", "ppo", "--debug-train-only"]


class FakeGroup:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def compute_values(self, data_refs):
        self.calls.append((self.name, "values"))
        return [f"values-{self.name}"]

    def train(self, rollout_id, data_refs, extras):
        self.calls.append((self.name, "train", rollout_id, extras))
        return {f"train/{self.name}_trained": 1.0}


def _run(monkeypatch, *extra):
    monkeypatch.setattr(job_module.ray, "get", lambda value, **kwargs: value)
    job = Job(parse_args(BASE + list(extra)))
    calls = []
    job.actor, job.critic = FakeGroup("actor", calls), FakeGroup("critic", calls)
    metrics = [job.train(rollout_id, ["data"]) for rollout_id in range(4)]
    return calls, metrics


def test_critic_only_steps_hold_the_actor_back(monkeypatch):
    calls, metrics = _run(monkeypatch, "--num-critic-only-steps", "2")
    trained = [(c[0], c[2]) for c in calls if c[1] == "train"]
    assert trained == [("critic", 0), ("critic", 1), ("critic", 2), ("actor", 2), ("critic", 3), ("actor", 3)]
    assert [("train/actor_trained" in m) for m in metrics] == [False, False, True, True]
    assert ("actor", "train", 2, [["values-critic"]]) in calls  # the actor trains on the critic's values


def test_without_critic_only_steps_both_train_from_the_start(monkeypatch):
    calls, _ = _run(monkeypatch)
    assert [(c[0], c[2]) for c in calls if c[1] == "train"][:2] == [("critic", 0), ("actor", 0)]

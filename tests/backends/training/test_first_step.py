"""The first optimizer step of a rollout step with the old-policy pass run for real (not skipped): the
recomputed π_old equals the training forward's log π_θ bit for bit, so ``ppo_kl`` and ``pg_clipfrac``
are exactly 0 — and the check catches a π_old pass that differs from the training forward."""

import pytest

from slime.backends.training.worker import TrainWorker
from tests.backends.fsdp_utils.fsdp_test_utils import make_args, make_samples, rank_data

pytestmark = pytest.mark.usefixtures("single_rank")

FLAGS = ("--num-steps-per-rollout", "2", "--micro-batch-size", "2", "--lr", "1e-3", "--entropy-coef", "0.01")


def _worker(tiny_model_dir):
    args = make_args(tiny_model_dir, *FLAGS, rbs=4)
    worker = TrainWorker(args)
    worker.init()
    return worker, rank_data(args, make_samples(8, seed=2))


def test_first_step_ppo_kl_is_exactly_zero_with_the_old_policy_pass(tiny_model_dir):
    worker, data = _worker(tiny_model_dir)
    assert len(data.schedule.num_microbatches) == 2 and not worker.skips_old_log_prob_pass(data)
    passes = worker.forward_only_passes
    metrics = worker.train(0, data)
    assert worker.forward_only_passes == passes + 1  # the π_old pass ran
    assert "rollout/log_probs" in metrics
    first, second = worker.get_step_metrics()
    assert first["train/ppo_kl"] == 0.0 and first["train/pg_clipfrac"] == 0.0
    assert second["train/ppo_kl"] != 0.0  # the second step sees the weights after the first update


def test_a_pi_old_pass_unlike_the_training_forward_breaks_the_invariant(tiny_model_dir):
    """π_old computed at another temperature than the training forward (a broken pass): ppo_kl ≠ 0."""
    worker, data = _worker(tiny_model_dir)
    args = worker.args
    temperature = args.rollout_temperature
    args.rollout_temperature = temperature * 1.5
    try:
        broken = worker.compute_log_probs(data)
    finally:
        args.rollout_temperature = temperature
    worker.train(0, data.replace(**broken))
    assert worker.get_step_metrics()[0]["train/ppo_kl"] != 0.0

"""The training-schedule flags on the FSDP worker: --ref-update-interval copies the actor into the
reference model every N rollout steps (and only then), --reset-optimizer-states starts every rollout
step with a fresh Adam state."""

import copy

import pytest
import torch

from slime.backends.training.worker import TrainWorker
from tests.backends.fsdp_utils.fsdp_test_utils import make_args, make_samples, rank_data

pytestmark = pytest.mark.usefixtures("single_rank")


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ref_update_interval_copies_the_actor_into_the_reference_every_n_steps(tiny_model_dir):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--lr", "1e-2", "--use-kl-loss",
                     "--kl-loss-coef", "0.1", "--ref-update-interval", "2")
    worker = TrainWorker(args)
    worker.init()
    backend, data = worker.backend, rank_data(args, make_samples(4))
    initial = _full(backend.ref_model)
    worker.train(0, copy.copy(data))
    assert _same(_full(backend.ref_model), initial) and not _same(_full(backend.model), initial)
    worker.train(1, copy.copy(data))  # (1 + 1) % 2 == 0: the reference becomes the actor
    after_update = _full(backend.model)
    assert _same(_full(backend.ref_model), after_update)
    metrics = worker.train(2, copy.copy(data))
    assert _same(_full(backend.ref_model), after_update) and not _same(_full(backend.model), after_update)
    assert metrics["train/kl_loss"] == 0.0  # the first step after the copy: π_θ is the reference


def test_reset_optimizer_states_starts_each_rollout_step_with_fresh_adam_state(tiny_model_dir):
    flags = ("--num-steps-per-rollout", "2", "--lr", "1e-3")
    data = rank_data(make_args(tiny_model_dir, *flags), make_samples(4))
    kept, reset = TrainWorker(make_args(tiny_model_dir, *flags)), TrainWorker(make_args(tiny_model_dir, *flags,
                                                                                        "--reset-optimizer-states"))
    kept.init()
    reset.init()
    for worker in (kept, reset):
        worker.train(0, copy.copy(data))
    assert {float(s["step"]) for s in kept.backend.optimizer.state.values()} == {2.0}
    assert len(reset.backend.optimizer.state) == 0
    assert _same(_full(kept.backend.model), _full(reset.backend.model))  # rollout step 0: the same updates
    # rollout step 1 restarts Adam's moments and bias correction: the same as a fresh optimizer from these weights
    fresh = TrainWorker(make_args(tiny_model_dir, *flags))
    fresh.init()
    fresh.backend.model.load_state_dict(reset.backend.model.state_dict())
    reset.train(1, copy.copy(data))
    fresh.train(1, copy.copy(data))
    kept.train(1, copy.copy(data))
    assert _same(_full(reset.backend.model), _full(fresh.backend.model))
    assert not _same(_full(reset.backend.model), _full(kept.backend.model))

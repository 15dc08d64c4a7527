"""The typed train-data record and the documented ``rollout_data`` dict user hooks receive (docs/INTERFACES.md §2.9,
§2.21, §7.7): the dict view carries the documented keys, and what a hook changes is what the trainer
uses."""

import sys
import types

import pytest
import torch

from slime.backends.training.worker import TrainWorker
from tests.backends.fsdp_utils.fsdp_test_utils import make_args, make_samples, rank_data

# docs/INTERFACES.md §7.7 per-rank keys the default conversion produces, the schedule, the trainer's local lengths
DOCUMENTED_KEYS = {
    "partition", "tokens", "response_lengths", "rewards", "truncated", "loss_masks", "sample_indices", "rollout_ids",
    "rollout_mask_sums", "rollout_log_probs", "prompt", "raw_reward", "total_lengths", "global_batch_sizes",
    "num_microbatches", "micro_batch_indices", "total_lengths_local",
}


def test_dict_view_has_the_documented_keys_and_reads_back_edits(tiny_model_dir):
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "2")
    batch = rank_data(args, make_samples(4))
    view = batch.as_rollout_data()
    assert DOCUMENTED_KEYS <= set(view), DOCUMENTED_KEYS - set(view)
    assert view["micro_batch_indices"] is batch.schedule.micro_batch_indices
    assert view["total_lengths_local"] == [int(t.numel()) for t in batch.tokens]
    view["loss_masks"][0] = torch.zeros_like(view["loss_masks"][0])  # in place: the record sees it
    view["advantages"] = [torch.ones(int(n)) for n in batch.response_lengths]
    view["my_note"] = "kept"
    edited = batch.with_rollout_data(view)
    assert int(batch.loss_masks[0].sum()) == 0 and edited.advantages is view["advantages"]
    assert edited.extra == {"my_note": "kept"} and edited.as_rollout_data()["my_note"] == "kept"
    assert edited.schedule is batch.schedule and batch.advantages is None  # the original is not replaced
    del view["advantages"]
    assert batch.with_rollout_data(view).advantages is None


@pytest.mark.usefixtures("single_rank")
def test_hooks_edits_reach_the_loss(tiny_model_dir, monkeypatch):
    """A custom advantage function's advantages and a postprocess hook's loss-mask edit are what trains."""
    seen = {}
    module = types.ModuleType("_batch_hooks")

    def advantages(args, rollout_data):
        seen["kl"] = "kl" in rollout_data
        rollout_data["advantages"] = [torch.zeros(int(n)) for n in rollout_data["response_lengths"]]
        rollout_data["returns"] = rollout_data["advantages"]

    def postprocess(args, rollout_id, rollout_data):
        seen["advantages"] = all(float(a.abs().sum()) == 0 for a in rollout_data["advantages"])
        for mask in rollout_data["loss_masks"]:
            mask.zero_()

    module.advantages, module.postprocess = advantages, postprocess
    monkeypatch.setitem(sys.modules, "_batch_hooks", module)
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--custom-advantage-function-path", "_batch_hooks.advantages")
    worker = TrainWorker(args)
    worker.init()
    metrics = worker.train(0, rank_data(args, make_samples(4)))
    assert seen["kl"] and metrics["train/pg_loss"] == 0.0 and metrics["rollout/advantages"] == 0.0
    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "1", "--rollout-data-postprocess-path", "_batch_hooks.postprocess")
    worker = TrainWorker(args)
    worker.init()
    metrics = worker.train(0, rank_data(args, make_samples(4, seed=3)))
    assert not seen["advantages"]  # the estimator's advantages reached the hook
    assert metrics["train/pg_loss"] == 0.0 and metrics["train/entropy_loss"] == 0.0  # every token masked by the hook
    assert metrics["train/grad_norm"] == 0.0


def test_a_pickled_batch_carries_one_tensor_a_column_and_comes_back_equal(tiny_model_dir):
    """What Ray's object store holds between the rollout manager and the trainers: each per-sample tensor column
    packed into one flat tensor (torch pickles every storage on its own), unpacked into the same values,
    dtypes and shapes; a copy shares the tensors."""
    import copy
    import pickle

    args = make_args(tiny_model_dir, "--num-steps-per-rollout", "2")
    batch = rank_data(args, make_samples(6))
    batch = batch.replace(advantages=[torch.randn(int(n)) for n in batch.response_lengths],
                          rollout_top_p_token_offsets=[torch.zeros(0, dtype=torch.int32)] + [
                              torch.arange(3, dtype=torch.int32) for _ in range(len(batch) - 1)])
    state = batch.__getstate__()
    packed = [name for name, value in state.items() if type(value).__name__ == "_PackedColumn"]
    assert {"tokens", "loss_masks", "rollout_log_probs", "advantages", "rollout_top_p_token_offsets"} <= set(packed)
    assert all(isinstance(t, torch.Tensor) for t in batch.tokens)  # the record itself is untouched
    back = pickle.loads(pickle.dumps(batch))
    for name in packed:
        original, restored = getattr(batch, name), getattr(back, name)
        assert len(original) == len(restored), name
        for a, b in zip(original, restored):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert back.schedule == batch.schedule and back.rewards == batch.rewards and back.partition == batch.partition
    assert torch.equal(back.rollout_mask_sums, batch.rollout_mask_sums)
    mixed = batch.replace(metadata=[{"k": 1}] * len(batch))  # not tensors: pickled as they are
    assert pickle.loads(pickle.dumps(mixed)).metadata == mixed.metadata
    shallow = copy.copy(batch)
    assert shallow.tokens is batch.tokens and shallow.tokens[0] is batch.tokens[0]

"""The train-data contract: conversion (§7.7, §2.13, §2.14) and the DP/step split (§1.8.7)."""

import json
import math

import pytest
import torch

from slime.arguments import parse_args
from slime.backends.training.train_data import assign_rollout_ids, convert_samples_to_train_data, split_train_data_by_dp
from slime.utils.types import Sample


def make_args(*extra, rbs=2, n=2):
    return parse_args(
        ["--train-backend", "fsdp", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "1",
         "--rollout-batch-size", str(rbs), "--n-samples-per-prompt", str(n), *extra]
    )


def sample(index, group, reward, prompt_len=3, response_len=2, **kw):
    return Sample(
        index=index, group_index=group, tokens=list(range(1, prompt_len + response_len + 1)),
        response_length=response_len, reward=reward, status=Sample.Status.COMPLETED, **kw,
    )


def test_basic_conversion_fields_and_grpo_rewards():
    args = make_args("--num-steps-per-rollout", "1")
    samples = [sample(0, 0, 1.0), sample(1, 0, 0.0), sample(2, 1, 1.0, remove_sample=True), sample(3, 1, 1.0, loss_mask=[0, 1])]
    samples[1].status = Sample.Status.TRUNCATED
    data = convert_samples_to_train_data(args, samples)
    assert data["raw_reward"] == [1.0, 0.0, 1.0, 1.0]
    s = 1 / (math.sqrt(0.5) + 1e-6)
    assert data["rewards"] == pytest.approx([0.5 * s, -0.5 * s, 0.0, 0.0], abs=1e-5)
    assert data["loss_masks"] == [[1, 1], [1, 1], [0, 0], [0, 1]]
    assert data["truncated"] == [0, 1, 0, 0]
    assert data["sample_indices"] == [0, 1, 2, 3]
    assert data["rollout_ids"] == [0, 1, 2, 3]
    assert data["rollout_mask_sums"] == [2.0, 2.0, 0.0, 1.0]


def test_dr_grpo_and_ppo_rewards():
    samples = [sample(0, 0, 1.0), sample(1, 0, 0.0), sample(2, 1, 3.0), sample(3, 1, 5.0)]
    data = convert_samples_to_train_data(make_args("--num-steps-per-rollout", "1", "--disable-grpo-std-normalization"), samples)
    assert data["rewards"] == pytest.approx([0.5, -0.5, -1.0, 1.0])
    data = convert_samples_to_train_data(make_args("--num-steps-per-rollout", "1", "--advantage-estimator", "ppo"), samples)
    assert data["rewards"] == [1.0, 0.0, 3.0, 5.0]


def test_fan_out_rollout_ids_and_rollout_aware_rewards():
    args = make_args("--num-steps-per-rollout", "1")
    # group 0: rollout 7 has two segments (reward 1), a plain sample (reward 0); group 1: two plain samples
    samples = [
        sample(0, 0, 1.0, rollout_id=7), sample(1, 0, 1.0, rollout_id=7, response_len=3), sample(2, 0, 0.0),
        sample(3, 1, 2.0), sample(4, 1, 2.0),
    ]
    assert assign_rollout_ids(samples) == [7, 7, 0, 1, 2]
    data = convert_samples_to_train_data(args, samples)
    assert data["rollout_mask_sums"] == [5.0, 5.0, 2.0, 2.0, 2.0]
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert data["rewards"] == pytest.approx([s, s, -s, 0.0, 0.0], abs=1e-5)


def test_grpo_normalize_by_group_index_groups_by_prompt_even_when_the_batch_looks_positional():
    # 4 samples = rollout_batch_size x n, but interleaved: the default takes rows [0,1] [2,3], the helper
    # the prompt groups {0: rewards 1, 0} and {1: rewards 3, 5}
    args = make_args("--num-steps-per-rollout", "1", "--custom-reward-post-process-path",
                     "slime.rollout._fanout_test_helpers.grpo_normalize_by_group_index")
    samples = [sample(0, 0, 1.0), sample(1, 1, 3.0), sample(2, 0, 0.0), sample(3, 1, 5.0)]
    data = convert_samples_to_train_data(args, samples)
    s0, s1 = 0.5 / (math.sqrt(0.5) + 1e-6), 1.0 / (math.sqrt(2.0) + 1e-6)
    assert data["rewards"] == pytest.approx([s0, -s1, -s0, s1], abs=1e-5)
    positional = convert_samples_to_train_data(make_args("--num-steps-per-rollout", "1"), samples)["rewards"]
    assert positional != pytest.approx(data["rewards"], abs=1e-3)
    # fan-out: one reward per rollout sets the baseline; samples without group_index fall back to rows of n
    fan = [sample(0, 0, 1.0, rollout_id=7), sample(1, 0, 1.0, rollout_id=7), sample(2, 0, 0.0), sample(3, 1, 6.0),
           sample(4, None, 2.0), sample(5, None, 4.0)]  # positions 4 and 5: the third row of n = 2
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    rows = 1.0 / (math.sqrt(2.0) + 1e-6)
    assert convert_samples_to_train_data(args, fan)["rewards"] == pytest.approx([s, s, -s, 0.0, -rows, rows], abs=1e-5)


def test_hooks_are_called(monkeypatch, tmp_path):
    import sys
    import types

    module = types.ModuleType("_train_data_hooks")
    module.post = lambda args, samples: ([1.0] * len(samples), [42.0] * len(samples))
    module.convert = lambda args, samples: {"tokens": [[1, 2]], "response_lengths": [1], "rewards": [0.0], "raw_reward": [0.0],
                                            "truncated": [0], "sample_indices": [0], "loss_masks": [[1]], "rollout_ids": [0]}
    module.bad = lambda args, samples: {"tokens": [[1]]}
    monkeypatch.setitem(sys.modules, "_train_data_hooks", module)
    samples = [sample(i, i // 2, 0.0) for i in range(4)]
    data = convert_samples_to_train_data(make_args("--num-steps-per-rollout", "1", "--custom-reward-post-process-path", "_train_data_hooks.post"), samples)
    assert data["rewards"] == [42.0] * 4 and data["raw_reward"] == [1.0] * 4
    data = convert_samples_to_train_data(make_args("--num-steps-per-rollout", "1", "--custom-convert-samples-to-train-data-path", "_train_data_hooks.convert"), samples)
    assert data["rollout_mask_sums"] == [1.0]
    with pytest.raises(ValueError, match="rollout_ids"):
        convert_samples_to_train_data(make_args("--num-steps-per-rollout", "1", "--custom-convert-samples-to-train-data-path", "_train_data_hooks.bad"), samples)


def test_optional_fields():
    args = make_args("--num-steps-per-rollout", "1")
    samples = [sample(i, i // 2, 1.0, rollout_log_probs=[-0.1, -0.2], train_metadata={"k": i}) for i in range(4)]
    samples[0].metadata["round_number"] = 3
    samples[1].metadata["raw_reward"] = 9.0
    data = convert_samples_to_train_data(args, samples)
    assert data["rollout_log_probs"][0] == [-0.1, -0.2]
    assert data["metadata"] == [{"k": i} for i in range(4)]
    assert data["round_number"][0] == 3
    assert data["raw_reward"] == [1.0, 9.0, 1.0, 1.0]
    samples[2].loss_mask = [1]
    with pytest.raises(ValueError, match="loss_mask"):
        convert_samples_to_train_data(args, samples)


def test_split_steps_ranks_and_fan_out():
    args = make_args("--num-steps-per-rollout", "2", rbs=3, n=2)  # 6 rollouts, gbs 3
    samples = [sample(i, i // 2, float(i), response_len=1 + i % 3) for i in range(6)]
    samples[1].rollout_id, samples[2].rollout_id = 100, 100  # fan-out: one rollout of two segments
    samples += [sample(6, 3, 0.0), sample(7, 3, 0.0)]  # 7 rollouts: the trailing one is dropped
    data = convert_samples_to_train_data(args, samples)
    shards = split_train_data_by_dp(args, data, dp_size=2)
    assert [s.schedule.global_batch_sizes for s in shards] == [[3, 3], [3, 3]]
    positions = sorted(p for s in shards for p in s.partition)
    assert positions == [0, 1, 2, 3, 4, 5, 6]
    assert shards[0].num_dropped_samples == 1
    # fan-out siblings on one rank, in one step
    owner = {p: r for r, s in enumerate(shards) for p in s.partition}
    assert owner[1] == owner[2]
    assert shards[0].schedule.num_microbatches == shards[1].schedule.num_microbatches
    assert len(shards[0].schedule.micro_batch_indices) == len(shards[1].schedule.micro_batch_indices) == sum(shards[0].schedule.num_microbatches)
    for s in shards:
        assert s.tokens[0].dtype == torch.int64 and s.loss_masks[0].dtype == torch.int32
        assert s.rollout_mask_sums.dtype == torch.float32
        assert sorted(i for mb in s.schedule.micro_batch_indices for i in mb) == list(range(len(s.partition)))


def test_split_balance_and_dynamic_batches():
    args = make_args("--num-steps-per-rollout", "1", "--balance-data", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "20", rbs=4, n=1)
    samples = [sample(i, i, 1.0, prompt_len=2, response_len=L) for i, L in enumerate([16, 2, 2, 12])]
    data = convert_samples_to_train_data(args, samples)
    shards = split_train_data_by_dp(args, data, dp_size=2)
    loads = [sum(len(t) for t in s.tokens) for s in shards]
    assert sorted(loads) == [18, 22]  # the optimum for lengths 18, 4, 4, 14
    for s in shards:
        for mb in s.schedule.micro_batch_indices:
            assert sum(int(s.tokens[i].numel()) for i in mb) <= 20
    assert shards[0].schedule.step_loss_token_counts == [32.0]
    with pytest.raises(ValueError, match="global-batch-size"):
        split_train_data_by_dp(make_args("--global-batch-size", "8", rbs=4, n=1), data, 1)


def test_dynamic_batches_hold_max_tokens_per_gpu_times_cp():
    """Under context parallelism each GPU holds 1/CP of a micro-batch: the budget per micro-batch is
    --max-tokens-per-gpu × --context-parallel-size (docs/INTERFACES.md §7.7)."""
    lengths = [16, 2, 2, 12]
    budgets = {}
    for cp in (1, 2):
        args = make_args("--num-steps-per-rollout", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "20", rbs=4, n=1)
        args.context_parallel_size = cp  # (a Megatron run's; parse_args checks Megatron-Core is installed for it)
        samples = [sample(i, i, 1.0, prompt_len=2, response_len=L) for i, L in enumerate(lengths)]
        (shard,) = split_train_data_by_dp(args, convert_samples_to_train_data(args, samples), dp_size=1)
        budgets[cp] = [sum(int(shard.tokens[i].numel()) for i in mb) for mb in shard.schedule.micro_batch_indices]
    assert max(budgets[1]) <= 20 and len(budgets[1]) >= 3
    assert max(budgets[2]) <= 40 and max(budgets[2]) > 20 and len(budgets[2]) < len(budgets[1])


def _flops_model_dir(tmp_path):
    """An HF config whose output head dominates the FLOPs (large vocabulary): a response token costs
    far more than a prompt token, so token counts and FLOPs disagree."""
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_balance_by_flops_gives_shards_balanced_in_flops(tmp_path):
    from slime.backends.training.train_data import sample_flops

    # (prompt, response): tokens 42, 22, 22, 20 — the token optimum pairs the two response-heavy samples
    shapes = [(40, 2), (2, 20), (2, 20), (18, 2)]
    samples = [sample(i, i, 1.0, prompt_len=p, response_len=r) for i, (p, r) in enumerate(shapes)]
    partitions, spreads = {}, {}
    dynamic = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "128"]
    for mode, flags in (("tokens", ["--balance-data"]), ("flops", ["--balance-by-flops"])):
        args = make_args("--num-steps-per-rollout", "1", "--hf-checkpoint", _flops_model_dir(tmp_path), *dynamic, *flags,
                         rbs=4, n=1)
        data = convert_samples_to_train_data(args, samples)
        shards = split_train_data_by_dp(args, data, dp_size=2)
        flops = sample_flops(args, [p + r for p, r in shapes], [r for _, r in shapes])
        partitions[mode] = sorted(sorted(s.partition) for s in shards)
        loads = [sum(flops[p] for p in s.partition) for s in shards]
        spreads[mode] = max(loads) / min(loads)
    assert partitions["tokens"] != partitions["flops"]
    assert partitions["flops"] == [[0, 1], [2, 3]] or partitions["flops"] == [[0, 2], [1, 3]]  # heavy ones apart
    assert spreads["flops"] < 1.2 < 2 < spreads["tokens"]


def test_balance_by_flops_needs_dynamic_batching_and_a_config(tmp_path):
    with pytest.raises(ValueError, match="--balance-by-flops .*--use-dynamic-batch-size"):
        make_args("--num-steps-per-rollout", "1", "--balance-by-flops", rbs=2, n=1)
    args = make_args("--num-steps-per-rollout", "1", "--balance-by-flops", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
                     "64", "--hf-checkpoint", str(tmp_path / "none"), rbs=2, n=1)
    data = convert_samples_to_train_data(args, [sample(i, i, 1.0) for i in range(2)])
    with pytest.raises(FileNotFoundError, match="--balance-by-flops .*config.json"):
        split_train_data_by_dp(args, data, dp_size=2)

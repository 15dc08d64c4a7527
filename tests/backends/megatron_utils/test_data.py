"""Shards of tensor-parallel peers merged into one data-parallel shard (CPU)."""

import torch

from slime.backends.megatron_utils.data import merge_shards
from slime.utils.arguments import parse_args
from slime.utils.train_data import convert_samples_to_train_data, split_train_data_by_dp
from tests.backends.fsdp_utils.fsdp_test_utils import make_samples


def _args(*extra):
    return parse_args(["--train-backend", "fsdp", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "1",
                       "--rollout-batch-size", "8", "--n-samples-per-prompt", "2", "--global-batch-size", "8", *extra])


def test_merged_shards_keep_every_sample_once_and_the_step_schedule():
    args = _args("--use-dynamic-batch-size", "--max-tokens-per-gpu", "12")
    data = convert_samples_to_train_data(args, make_samples(16, seed=3))
    shards = split_train_data_by_dp(args, data, 4)  # 4 ranks: TP 2 x DP 2
    merged = [merge_shards(shards[0:2], 0, 2), merge_shards(shards[2:4], 1, 2)]
    assert sorted(p for m in merged for p in m["partition"]) == list(range(16))
    for m, pair in zip(merged, (shards[0:2], shards[2:4])):
        assert m["dp_rank"] in (0, 1) and m["dp_size"] == 2
        assert m["num_microbatches"] == [2 * c for c in pair[0]["num_microbatches"]]
        assert len(m["micro_batch_indices"]) == sum(m["num_microbatches"])
        # every local position once, and each micro-batch holds the same samples as in its source shard
        flat = sorted(i for mb in m["micro_batch_indices"] for i in mb)
        assert flat == list(range(len(m["tokens"])))
        for mb in m["micro_batch_indices"]:
            assert sum(int(m["tokens"][i].numel()) for i in mb) <= 12 or len(mb) == 1
        assert isinstance(m["rollout_mask_sums"], torch.Tensor) and len(m["rollout_mask_sums"]) == len(m["tokens"])
        for i, position in enumerate(m["partition"]):
            assert torch.equal(m["tokens"][i], torch.as_tensor(data["tokens"][position]))
    assert merged[0]["num_microbatches"] == merged[1]["num_microbatches"]  # DP ranks stay in lock step


def test_a_single_shard_is_unchanged():
    args = _args()
    shard = split_train_data_by_dp(args, convert_samples_to_train_data(args, make_samples(16, seed=1)), 1)[0]
    merged = merge_shards([shard], 0, 1)
    assert merged["micro_batch_indices"] == shard["micro_batch_indices"] and merged["tokens"] is shard["tokens"]

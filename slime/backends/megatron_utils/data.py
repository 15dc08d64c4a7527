"""Train data for model-parallel peers: the ranks of a tensor-parallel group must see the same samples.

The rollout manager cuts each rollout step into one shard per training rank
(:func:`slime.utils.train_data.split_train_data_by_dp`). Megatron's TP peers compute one model
together, so they need one shard: :func:`merge_shards` joins the shards of a TP group into the shard
of its data-parallel rank — samples concatenated, and each optimizer step's micro-batches of every
peer kept in that step (so every rank still runs the same number of micro-batches per step).
Pure Python on dicts of lists and tensors; the all-gather is the caller's.
"""

from __future__ import annotations

import torch

from slime.utils.train_data import PER_SAMPLE_KEYS

__all__ = ["merge_shards"]


def merge_shards(shards: list[dict], dp_rank: int, dp_size: int) -> dict:
    """One shard made of ``shards`` (the per-rank shards of a TP group, in rank order)."""
    if len(shards) == 1:
        return {**shards[0], "dp_rank": dp_rank, "dp_size": dp_size}
    first = shards[0]
    steps = first["num_microbatches"]
    for shard in shards[1:]:
        if shard["num_microbatches"] != steps or shard["global_batch_sizes"] != first["global_batch_sizes"]:
            raise ValueError("shards of one rollout step disagree on the step schedule (num_microbatches / global_batch_sizes)")
    merged = {key: value for key, value in first.items() if key not in PER_SAMPLE_KEYS}
    offsets, total = [], 0
    for shard in shards:
        offsets.append(total)
        total += len(shard["tokens"])
    for key in PER_SAMPLE_KEYS:
        if key not in first:
            continue
        parts = [shard[key] for shard in shards]
        if all(isinstance(p, torch.Tensor) for p in parts):
            merged[key] = torch.cat(parts)
        else:
            merged[key] = [item for part in parts for item in part]
    merged["partition"] = [p for shard in shards for p in shard["partition"]]
    micro_batches, cursor = [], [0] * len(shards)
    for count in steps:
        for k, shard in enumerate(shards):
            for mb in shard["micro_batch_indices"][cursor[k]: cursor[k] + count]:
                micro_batches.append([offsets[k] + i for i in mb])
            cursor[k] += count
    merged["micro_batch_indices"] = micro_batches
    merged["num_microbatches"] = [count * len(shards) for count in steps]
    merged["dp_rank"], merged["dp_size"] = dp_rank, dp_size
    return merged

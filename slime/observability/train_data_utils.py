"""Train debug dump (docs/INTERFACES.md §7.6, format version 2): what each sample looked like to the trainer.

Every data-parallel rank sends its per-sample fields (tokens, masks, rewards, log-probs, advantages, ...)
to rank 0, which writes one file per rollout step at ``template.format(rollout_id=..., rank=0)``,
sorted by ``sample_index``; ``dp_shards`` keeps each rank's layout. Join it with the rollout dump on
``sample_index`` ↔ ``Sample.index``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

PER_SAMPLE_KEYS = ("tokens", "loss_masks", "response_lengths", "total_lengths_local", "rewards", "log_probs",
                   "ref_log_probs", "rollout_log_probs", "values", "advantages", "returns", "kl", "entropy",
                   "teacher_log_probs", "rollout_ids", "rollout_mask_sums", "truncated", "sample_indices")


def _cpu(value):
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def save_debug_train_data(template: str, rollout_id: int, rollout_data: dict) -> str | None:
    """Collective over the training ranks; rank 0 writes and returns the path."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    count = len(rollout_data["tokens"])
    samples = []
    for i in range(count):
        entry = {"data_parallel_rank": rank}
        for key in PER_SAMPLE_KEYS:
            column = rollout_data.get(key)
            if column is not None and len(column) == count:
                entry["total_lengths" if key == "total_lengths_local" else key] = _cpu(column[i])
        entry["sample_index"] = int(entry.pop("sample_indices")) if "sample_indices" in entry else None
        samples.append(entry)
    shard = {"rank": rank, "data_parallel_rank": rank,
             "sample_indices": [s["sample_index"] for s in samples],
             **{k: _cpu(rollout_data[k]) for k in ("partition", "micro_batch_indices", "num_microbatches",
                                                   "global_batch_sizes") if k in rollout_data}}
    gathered = [None] * dist.get_world_size() if dist.is_initialized() else [(samples, shard)]
    if dist.is_initialized():
        dist.all_gather_object(gathered, (samples, shard))
    if rank != 0:
        return None
    all_samples = [s for part, _ in gathered for s in part]
    all_samples.sort(key=lambda s: (s["sample_index"] is None, s["sample_index"] or 0))
    payload = {"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": all_samples,
               "dp_shards": [shard for _, shard in gathered], "raw_reward": _cpu(rollout_data.get("raw_reward"))}
    path = template.format(rollout_id=rollout_id, rank=0)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(payload, path)
    return path

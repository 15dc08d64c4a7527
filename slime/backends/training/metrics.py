"""Metrics reduced over the training ranks: the step's loss sums and the trainer-side rollout data.

Both are collective (every rank calls them). Ranks of one data-parallel replica hold the same
samples (:class:`~slime.backends.training.backend.DataLayout`), so sums over all ranks are
weighted to count each sample once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime.backends.training.backend import DataLayout

__all__ = ["TOKEN_WEIGHTED_KEYS", "PLAIN_MEAN_KEYS", "reduce_sums", "rollout_metrics"]

TOKEN_WEIGHTED_KEYS = ("log_probs", "ref_log_probs", "rollout_log_probs", "returns", "advantages", "values",
                       "teacher_log_probs", "opd_reverse_kl")
PLAIN_MEAN_KEYS = ("rewards", "response_lengths", "total_lengths", "truncated", "kl", "entropy")


def reduce_sums(sums: dict[str, torch.Tensor], normaliser: float, layout: DataLayout) -> dict[str, float]:
    """Σ over all ranks of each metric sum ÷ ``normaliser`` (docs/INTERFACES.md §5.8), each replica's copies counted once.

    Every rank must reduce the same keys in the same order; a rank that computed no loss in this step
    (no samples, or not the last pipeline stage) has none, so the key set is agreed first."""
    keys = sorted(sums)
    if dist.get_world_size() > 1:  # (an object all-gather pickles through the process group: skipped alone)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, keys)
        keys = sorted(set().union(*gathered))
    values = torch.stack([sums.get(k, torch.zeros((), dtype=torch.float64)) for k in keys]) if keys else torch.zeros(0)
    dist.all_reduce(values)
    return {k: float(v) / normaliser / layout.loss_copies for k, v in zip(keys, values)}


def _per_sample_means(column) -> list[float]:
    out = []
    for value in column:
        value = torch.as_tensor(value).float()
        out.append(float(value.mean()) if value.numel() else 0.0)
    return out


def rollout_metrics(batch, layout: DataLayout, device, correct_entropy: bool = False) -> dict[str, float]:
    """Of a :class:`~slime.backends.training.batch.TrainBatch`: ``rollout/<key>``: token-weighted per-rollout means for log-prob-like keys (Σ_i Σ_t x·m / D_i over
    all samples ÷ number of rollouts), plain sample means for the rest (docs/INTERFACES.md §5.9). With ``correct_entropy``
    (``--log-correct-samples``) also ``rollout/correct_entropy``: the mean entropy over the trained
    tokens of correct samples (raw reward exactly 1), 0 when the step has none."""
    keys, values = [], []
    share = 1.0 / layout.replica_size  # each replica's ranks hold the same samples
    world = dist.get_world_size()
    num_rollouts = float(sum(batch.schedule.global_batch_sizes)) / world
    masks, denominators = batch.loss_masks, batch.rollout_mask_sums
    for key in TOKEN_WEIGHTED_KEYS:
        column = getattr(batch, key)
        if column is None:
            continue
        total = 0.0
        for x, m, d in zip(column, masks, denominators):
            total += float((torch.as_tensor(x).float() * m.float()).sum()) / max(float(d), 1.0)
        keys.append(key)
        values += [total * share, num_rollouts]
    sources = {"total_lengths": batch.local_total_lengths}
    for key in (*PLAIN_MEAN_KEYS, "raw_reward"):
        column = sources[key] if key in sources else getattr(batch, key)
        if column is None:
            continue
        per_sample = _per_sample_means(column)
        keys.append(key)
        values += [sum(per_sample) * share, len(per_sample) * share]
    if correct_entropy and batch.entropy is not None:
        tokens = entropy_sum = 0.0
        for position, x, m in zip(batch.partition, batch.entropy, masks):
            if float(batch.raw_reward[position]) == 1:
                entropy_sum += float((torch.as_tensor(x).float() * m.float()).sum())
                tokens += float(m.sum())
        keys.append("correct_entropy")
        values += [entropy_sum * share, tokens * share]
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, keys)
        if any(g != keys for g in gathered):
            raise RuntimeError(f"ranks disagree on rollout_data keys: {gathered}")
    reduced = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(reduced)
    reduced = reduced.cpu()
    out = {}
    for i, key in enumerate(keys):
        total, count = reduced[2 * i], reduced[2 * i + 1]
        out[f"rollout/{key}"] = float(total / count) if count > 0 else 0.0
    return out

"""Samples → training data (docs/INTERFACES.md §7.7, §2.13, §2.14) and its split across data-parallel ranks.

``convert_samples_to_train_data(args, samples)`` runs in the rollout manager on the flattened
``list[Sample]`` and returns the whole-batch dict. ``split_train_data_by_dp(args, data, dp_size)``
cuts it into optimizer steps of exactly ``global_batch_size`` rollouts (§1.8.7), assigns whole
rollouts to data-parallel shards (token-balanced with ``--balance-data``), packs each shard's samples
into micro-batches (same count on every shard) and returns one typed
:class:`~slime.backends.training.batch.TrainBatch` per shard.

Reward grouping (§5.1 and the §1.8 item 9 caveat), decided as follows:

* no fan-out and ``N == rollout_batch_size × n_samples_per_prompt``: rows of ``n_samples_per_prompt``
  consecutive samples (the documented default);
* otherwise, when every sample has a ``group_index``: groups by ``group_index``, and a group's mean
  and std are taken over one reward per *rollout* (the mean of its segments), then applied to each
  segment — "each group's baseline is computed over rollouts, not samples" (seed 004, upstream PR #1918);
* otherwise the whole batch is one group (the documented fallback).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch

from slime.algorithms import functional as algo
from slime.backends.training.batch import StepSchedule, TrainBatch
from slime.backends.training.flops import FlopShape, training_flops
from slime.utils.misc import load_function
from slime.utils.seqlen_balancing import balanced_partition, micro_batch_schedule
from slime.utils.types import Sample

__all__ = [
    "convert_samples_to_train_data",
    "default_reward_post_process",
    "assign_rollout_ids",
    "split_train_data_by_dp",
    "PER_SAMPLE_KEYS",
]

# Per-sample keys that a DP split slices (everything else is whole-batch or schedule).
PER_SAMPLE_KEYS = (
    "tokens", "multimodal_train_inputs", "response_lengths", "rewards", "truncated", "loss_masks", "round_number",
    "sample_indices", "rollout_ids", "rollout_mask_sums", "rollout_log_probs", "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets", "rollout_routed_experts", "source_names", "prompt", "teacher_log_probs",
    "metadata",
)
WHOLE_BATCH_KEYS = ("raw_reward", "total_lengths")


def assign_rollout_ids(samples: list[Sample]) -> list[int]:
    """Each sample's rollout id; ``None`` gets a fresh integer not used by any explicit id,
    counting up from 0 (§1.8.6)."""
    used = {s.rollout_id for s in samples if s.rollout_id is not None}
    fresh, ids = 0, []
    for sample in samples:
        if sample.rollout_id is not None:
            ids.append(sample.rollout_id)
            continue
        while fresh in used:
            fresh += 1
        ids.append(fresh)
        used.add(fresh)
    return ids


def default_reward_post_process(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """(raw_rewards, rewards) per §5.1 with the rollout-aware grouping described in the module doc."""
    raw = [float(s.get_reward_value(args)) for s in samples]
    estimator = args.advantage_estimator
    normalise, std_allowed = algo.lookup(algo.REWARD_POST_PROCESSORS, estimator, "--advantage-estimator")
    if not normalise or not args.rewards_normalization or not samples:
        return raw, list(raw)
    std = std_allowed and args.grpo_std_normalization
    rollout_ids = assign_rollout_ids(samples)
    n = args.n_samples_per_prompt
    fan_out = len(set(rollout_ids)) < len(samples)
    expected = args.rollout_batch_size * n
    if not fan_out and len(samples) == expected:
        groups, per_rollout = algo.positional_groups(len(samples), n, expected), None
    elif all(s.group_index is not None for s in samples):
        groups, per_rollout = [s.group_index for s in samples], rollout_ids
    else:
        groups, per_rollout = [0] * len(samples), rollout_ids
    rewards = algo.group_normalize_rewards(torch.tensor(raw), groups, std, rollout_ids=per_rollout)
    return raw, rewards.tolist()


def _loss_mask(sample: Sample, position: int) -> list[int]:
    if sample.remove_sample:
        return [0] * sample.response_length
    if sample.loss_mask is None:
        return [1] * sample.response_length
    if len(sample.loss_mask) != sample.response_length:
        raise ValueError(
            f"sample {position} (index {sample.index}): loss_mask has {len(sample.loss_mask)} entries but "
            f"response_length is {sample.response_length}"
        )
    return [int(m) for m in sample.loss_mask]


def _optional_per_sample(samples: list[Sample], attribute: str, name: str, empty=None) -> list | None:
    """The field for every sample when the first sample with a response has it; error if later samples lack
    it. A sample that generated nothing (e.g. FAILED: its prompt was refused) gets ``empty()`` when given."""
    reference = next((s for s in samples if s.response_length > 0), samples[0])
    if getattr(reference, attribute) is None:
        return None
    values = [getattr(s, attribute) for s in samples]
    if empty is not None:
        values = [empty() if v is None and s.response_length == 0 else v for s, v in zip(samples, values)]
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise ValueError(f"{attribute} is set on the first sample but missing on samples {missing[:10]} ({name})")
    return values


def convert_samples_to_train_data(args, samples: list[Sample]) -> dict[str, Any]:
    """The training dict of §7.7 from the flattened samples (or the §2.14 hook's dict)."""
    custom = args.custom_convert_samples_to_train_data_path
    if custom:
        data = load_function(custom)(args, samples)
        return _check_custom_train_data(data, custom)
    if not samples:
        raise ValueError("convert_samples_to_train_data: no samples")
    post_path = args.custom_reward_post_process_path
    raw_rewards, rewards = (load_function(post_path) if post_path else default_reward_post_process)(args, samples)
    if len(rewards) != len(samples) or len(raw_rewards) != len(samples):
        raise ValueError(
            f"reward post-process returned {len(raw_rewards)} raw rewards and {len(rewards)} rewards for "
            f"{len(samples)} samples"
        )
    loss_masks = [_loss_mask(s, i) for i, s in enumerate(samples)]
    rollout_ids = assign_rollout_ids(samples)
    data: dict[str, Any] = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [float(r) for r in rewards],
        "raw_reward": [float(r) for r in raw_rewards],
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": loss_masks,
        "rollout_ids": rollout_ids,
        "rollout_mask_sums": _rollout_mask_sums(rollout_ids, loss_masks),
        "prompt": [s.prompt for s in samples],
    }
    if any("raw_reward" in s.metadata for s in samples):
        data["raw_reward"] = [float(s.metadata.get("raw_reward", r)) for s, r in zip(samples, data["raw_reward"])]
    for attribute, key in (
        ("rollout_log_probs", "rollout_log_probs"),
        ("teacher_log_probs", "teacher_log_probs"),
        ("rollout_top_p_token_ids", "rollout_top_p_token_ids"),
        ("rollout_top_p_token_offsets", "rollout_top_p_token_offsets"),
        ("rollout_routed_experts", "rollout_routed_experts"),
    ):
        empty = list if key in ("rollout_log_probs", "teacher_log_probs") else None  # one entry per response token
        values = _optional_per_sample(samples, attribute, key, empty)
        if values is not None:
            data[key] = values
    for key in ("rollout_log_probs", "teacher_log_probs"):
        for i, (values, n) in enumerate(zip(data.get(key, []), data["response_lengths"])):
            if len(values) != n:
                raise ValueError(f"sample {i}: {key} has {len(values)} entries, response_length is {n}")
    if samples[0].train_metadata is not None:
        data["metadata"] = [s.train_metadata for s in samples]
    if "round_number" in samples[0].metadata:
        data["round_number"] = [s.metadata.get("round_number") for s in samples]
    if any(s.multimodal_train_inputs is not None for s in samples):
        data["multimodal_train_inputs"] = [s.multimodal_train_inputs for s in samples]
    if any(getattr(s, "source", None) is not None or "source_name" in s.metadata for s in samples):
        data["source_names"] = [getattr(s, "source", None) or s.metadata.get("source_name") for s in samples]
    return data


def _rollout_mask_sums(rollout_ids: list, loss_masks: list) -> list[float]:
    totals: dict = {}
    for rid, mask in zip(rollout_ids, loss_masks):
        totals[rid] = totals.get(rid, 0) + int(sum(int(m) for m in mask))
    return [float(totals[rid]) for rid in rollout_ids]


def _check_custom_train_data(data: dict, path: str) -> dict:
    required = ("tokens", "response_lengths", "rewards", "raw_reward", "truncated", "sample_indices", "loss_masks", "rollout_ids")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"--custom-convert-samples-to-train-data-path {path}: the returned dict lacks {missing}")
    if "rollout_mask_sums" not in data:  # absent → per-sample denominators (§2.14)
        data["rollout_mask_sums"] = [float(sum(int(m) for m in mask)) for mask in data["loss_masks"]]
    return data


# --------------------------------------------------------------------------- DP split


def _tensorise(key: str, values: list) -> list:
    dtype = {
        "tokens": torch.int64, "loss_masks": torch.int32, "rollout_log_probs": torch.float32,
        "teacher_log_probs": torch.float32, "rollout_top_p_token_ids": torch.int32,
        "rollout_top_p_token_offsets": torch.int32,
    }.get(key)
    if dtype is None:
        return values
    return [v.to(dtype) if isinstance(v, torch.Tensor) else torch.tensor(list(v), dtype=dtype) for v in values]


@functools.lru_cache(maxsize=4)
def _flop_shape(hf_checkpoint: str):
    path = os.path.join(hf_checkpoint or "", "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--balance-by-flops estimates FLOPs from the model's config: {path!r} does not "
                                "exist (set --hf-checkpoint to the HF model directory)")
    with open(path) as f:
        config = json.load(f)
    return FlopShape.from_hf_config(config.get("text_config", config))


def sample_flops(args, total_lengths: list[int], response_lengths: list[int]) -> list[float]:
    """Training FLOPs of each sample alone (:func:`slime.backends.training.flops.training_flops`,
    the output head over its response positions): what ``--balance-by-flops`` balances."""
    shape = _flop_shape(args.hf_checkpoint)
    return [training_flops(shape, [int(length)], int(response)) for length, response in zip(total_lengths, response_lengths)]


def split_train_data_by_dp(args, data: dict, dp_size: int) -> list:
    """Cut ``data`` into steps of ``global_batch_size`` rollouts and into ``dp_size`` shards, one
    :class:`~slime.backends.training.batch.TrainBatch` each (every rank of a data-parallel replica
    trains on the same one).

    A shard holds the per-sample columns restricted to its samples (tensorised: tokens int64,
    loss_masks int32, log-prob fields float32, ``rollout_mask_sums`` a float32 tensor), the whole-batch
    ``raw_reward`` and ``total_lengths``, ``partition`` (global positions of its samples, step after
    step), ``dp_rank``/``dp_size``, and the :class:`~slime.backends.training.batch.StepSchedule`:
    ``global_batch_sizes`` (rollouts per step), ``num_microbatches`` (per step, equal on every shard),
    ``micro_batch_indices`` (per micro-batch, all steps in order, lists of local positions; may be
    empty), ``step_loss_token_counts`` (per step, Σ_i max(Σ_t m, 1) over all shards — the per-token
    normaliser).
    """
    num_samples = len(data["tokens"])
    rollout_ids = list(data["rollout_ids"])
    total_lengths = [len(t) for t in data["tokens"]]
    order: list = []
    members: dict = {}
    for position, rid in enumerate(rollout_ids):
        if rid not in members:
            order.append(rid)
            members[rid] = []
        members[rid].append(position)
    gbs = args.global_batch_size
    num_steps = len(order) // gbs
    if num_steps < 1:
        raise ValueError(
            f"{len(order)} rollouts do not fill one optimizer step of --global-batch-size {gbs} rollouts"
        )
    max_tokens = args.max_tokens_per_gpu if args.use_dynamic_batch_size else None
    if max_tokens is not None:  # under context parallelism each GPU holds 1/CP of a micro-batch's tokens
        max_tokens *= args.context_parallel_size or 1
    # the cost balanced across DP ranks and micro-batches: tokens, or training FLOPs (--balance-by-flops)
    costs = sample_flops(args, total_lengths, data["response_lengths"]) if args.balance_by_flops \
        else total_lengths
    rank_positions: list[list[int]] = [[] for _ in range(dp_size)]
    rank_micro_batches: list[list[list[int]]] = [[] for _ in range(dp_size)]
    num_microbatches, token_counts = [], []
    for step in range(num_steps):
        step_rollouts = order[step * gbs : (step + 1) * gbs]
        if args.balance_data:  # (--balance-by-flops turns it on)
            weights = [sum(costs[p] for p in members[r]) for r in step_rollouts]
            assignment = balanced_partition(weights, dp_size)
        else:
            assignment = [list(range(rank, len(step_rollouts), dp_size)) for rank in range(dp_size)]
        step_positions = [sorted(p for j in assignment[rank] for p in members[step_rollouts[j]]) for rank in range(dp_size)]
        schedule = micro_batch_schedule(
            [[total_lengths[p] for p in positions] for positions in step_positions],
            max_tokens,
            args.micro_batch_size or 1,
            [[costs[p] for p in positions] for positions in step_positions],
        )
        num_microbatches.append(len(schedule[0]))
        token_counts.append(
            float(sum(max(sum(int(m) for m in data["loss_masks"][p]), 1) for positions in step_positions for p in positions))
        )
        for rank in range(dp_size):
            offset = len(rank_positions[rank])
            rank_positions[rank].extend(step_positions[rank])
            rank_micro_batches[rank].extend([[offset + i for i in mb] for mb in schedule[rank]])
    dropped = num_samples - sum(len(p) for p in rank_positions)
    schedule_fields = dict(global_batch_sizes=[gbs] * num_steps, num_microbatches=num_microbatches,
                           step_loss_token_counts=token_counts)
    whole_batch = {key: data[key] for key in WHOLE_BATCH_KEYS if key in data and key != "total_lengths"}
    result = []
    for rank in range(dp_size):
        positions = rank_positions[rank]
        columns = {key: _tensorise(key, [data[key][p] for p in positions])
                   for key in PER_SAMPLE_KEYS if key in data and data[key] is not None}
        columns["rollout_mask_sums"] = torch.tensor([float(data["rollout_mask_sums"][p]) for p in positions], dtype=torch.float32)
        schedule = StepSchedule(micro_batch_indices=rank_micro_batches[rank], **schedule_fields)
        result.append(TrainBatch(schedule=schedule, partition=positions, total_lengths=total_lengths, dp_rank=rank,
                                 dp_size=dp_size, num_dropped_samples=dropped, **whole_batch, **columns))
    return result


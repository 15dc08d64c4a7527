"""Reward post-processing for uneven fan-out (docs/INTERFACES.md §1.8 item 9), by its upstream name.

``--custom-reward-post-process-path slime.rollout._fanout_test_helpers.grpo_normalize_by_group_index``
normalises rewards within prompt groups (``Sample.group_index``) whatever the batch's size, each group's
baseline taken over one reward per rollout (the mean of its segments) and applied to every segment.
slime's default post-processing already does this whenever the batch is not the plain
``rollout_batch_size × n_samples_per_prompt`` rows; this helper does it always. Samples without a
``group_index`` fall back to rows of ``n_samples_per_prompt`` in order.
"""

from __future__ import annotations

import torch

from slime.algorithms import functional as algo
from slime.backends.training.train_data import assign_rollout_ids
from slime.utils.types import Sample


def grpo_normalize_by_group_index(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    raw = [float(s.get_reward_value(args)) for s in samples]
    estimator = args.advantage_estimator
    normalise, std_allowed = algo.lookup(algo.REWARD_POST_PROCESSORS, estimator, "--advantage-estimator")
    if not normalise or not args.rewards_normalization or not samples:
        return raw, list(raw)
    n = args.n_samples_per_prompt
    groups = [s.group_index if s.group_index is not None else ("row", position // n)
              for position, s in enumerate(samples)]
    std = std_allowed and args.grpo_std_normalization
    rewards = algo.group_normalize_rewards(torch.tensor(raw), groups, std, rollout_ids=assign_rollout_ids(samples))
    return raw, rewards.tolist()

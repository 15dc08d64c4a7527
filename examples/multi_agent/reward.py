"""Reward post-processing of the multi-agent example: GRPO normalisation per role.

The default normaliser would average a slot's solver and critic rewards into one reward per rollout;
here each role's reward is compared with the same role's rewards in the prompt group (the
``n_samples_per_prompt`` slots of one problem): r ← (r − mean) / (std + ε), std omitted under
``--disable-grpo-std-normalization``.

    --custom-reward-post-process-path examples.multi_agent.reward.post_process
"""

from __future__ import annotations

import torch

from slime.utils import ppo_utils


def post_process(args, samples) -> tuple[list[float], list[float]]:
    raw = [float(s.get_reward_value(args)) for s in samples]
    groups = [(s.group_index, s.metadata.get("agent")) for s in samples]
    std = getattr(args, "grpo_std_normalization", True)
    return raw, ppo_utils.group_normalize_rewards(torch.tensor(raw), groups, std).tolist()

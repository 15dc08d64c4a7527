"""Reward post-processing of the multi-agent example: a class-balanced critic, then GRPO per role.

The default normaliser would average a slot's solver and critic rewards into one reward per rollout;
here each role is normalised against the same role in the prompt group (the
``n_samples_per_prompt`` slots of one problem): r ← (r − mean) / (std + ε), std omitted under
``--disable-grpo-std-normalization``.

Before that, the critic's reward is balanced over the two kinds of answer it judges. Its raw reward
is 1 for a verdict that is the truth about the solver's answer; with a solver that is mostly wrong,
saying ``no`` to everything would earn nearly full marks. So a right verdict on a **right** answer is
worth ``n / (2 n_right)`` and on a **wrong** answer ``n / (2 n_wrong)`` (``n`` the critic turns of the
step, ``n_right`` / ``n_wrong`` those judging right / wrong solver answers): the step's mean critic
reward is then its balanced accuracy, and a critic that always says ``no`` (or always ``yes``) earns
0.5, like a coin. A step whose solver answers are all right or all wrong has nothing to balance and
keeps the raw rewards. The solver's reward is its correctness, unchanged.

    --custom-reward-post-process-path examples.multi_agent.reward.post_process

Returns ``(raw, normalised)``: the raw rewards (what is logged as ``rollout/raw_reward``: the solver's
and critic's accuracy) and the advantages' input.
"""

from __future__ import annotations

import torch

from slime.algorithms import functional as algo

CRITIC = "critic"


def balanced_critic_rewards(samples, raw: list[float]) -> list[float]:
    """``raw`` with each critic reward weighted by ``n / (2 n_class)`` of the solver answer it judged."""
    critic = [i for i, s in enumerate(samples) if s.metadata.get("agent") == CRITIC]
    counts = {True: 0, False: 0}
    for i in critic:
        counts[bool(samples[i].metadata.get("solver_correct"))] += 1
    if not counts[True] or not counts[False]:
        return list(raw)
    weights = {kind: len(critic) / (2 * count) for kind, count in counts.items()}
    balanced = list(raw)
    for i in critic:
        balanced[i] = raw[i] * weights[bool(samples[i].metadata.get("solver_correct"))]
    return balanced


def post_process(args, samples) -> tuple[list[float], list[float]]:
    raw = [float(s.get_reward_value(args)) for s in samples]
    groups = [(s.group_index, s.metadata.get("agent")) for s in samples]
    std = getattr(args, "grpo_std_normalization", True)
    balanced = torch.tensor(balanced_critic_rewards(samples, raw))
    return raw, algo.group_normalize_rewards(balanced, groups, std).tolist()

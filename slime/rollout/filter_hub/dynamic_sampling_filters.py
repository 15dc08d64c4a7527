"""Built-in dynamic-sampling filters: drop prompt groups whose rewards carry no learning signal."""

from __future__ import annotations

import math

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]


def _leaves(samples) -> list[Sample]:
    out = []
    for item in samples:
        out.extend(_leaves(item) if isinstance(item, list) else [item])
    return out


def _unbiased_std(values: list[float]) -> float:
    if len(values) < 2:
        return math.nan
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def check_reward_nonzero_std(args, samples, **kwargs) -> DynamicFilterOutput:
    """Keep the group iff the unbiased std of its rewards exceeds 1e-6 (a group of one is dropped)."""
    rewards = [float(s.get_reward_value(args)) for s in _leaves(samples)]
    std = _unbiased_std(rewards)
    keep = bool(std > 1e-6)  # NaN compares False: single-sample groups are dropped
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args, samples, **kwargs) -> DynamicFilterOutput:
    """Like :func:`check_reward_nonzero_std`, but keep zero-std groups when candidates run short."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output

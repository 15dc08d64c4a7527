"""Reward of the tool-use task (``--custom-rm-path examples.tool_use.reward.reward``).

1.0 when the episode's final answer is the problem's temperature, else 0.0 — whether or not the tool
was used. The reading is only reachable through the tool, so an answer without a call is right one
time in ten, while a call returns the answer to copy. The generate function stores what
it saw in each sample's metadata (``final_answer``, ``tool_calls``, ``turns``); a fan-out list is
scored in one call and every segment of an episode gets the episode's reward.
"""

from __future__ import annotations


def score(label: str, final_answer: str | None) -> float:
    return 1.0 if final_answer is not None and final_answer.strip() == str(label).strip() else 0.0


async def reward(args, sample_or_samples, **kwargs):
    """Single mode (one sample → float) and batch mode (a session's segments → list of floats)."""
    if isinstance(sample_or_samples, list):
        return [_sample_score(s) for s in sample_or_samples]
    return _sample_score(sample_or_samples)


def _sample_score(sample) -> float:
    if sample.remove_sample:
        return 0.0
    return score(sample.label, sample.metadata.get("final_answer"))

"""Reward of the tool-use task (``--custom-rm-path examples.tool_use.reward.reward``).

0.5 for calling ``get_weather`` with the asked city, plus 0.5 when the final answer is then that
city's weather; 0.0 otherwise (an answer without the right lookup gets no credit: the forecast is
only reachable through the tool). The generate function stores what it saw in each sample's
metadata (``final_answer``, ``tool_calls``, ``city``); a fan-out list is scored in one call and every
segment of an episode gets the episode's reward.
"""

from __future__ import annotations


def score(label: str, city: str, final_answer: str | None, tool_calls: list[dict]) -> float:
    looked_up = any(c.get("name") == "get_weather" and isinstance(c.get("arguments"), dict)
                    and c["arguments"].get("city") == city for c in tool_calls)
    if not looked_up:
        return 0.0
    return 1.0 if final_answer is not None and final_answer.strip() == label else 0.5


async def reward(args, sample_or_samples, **kwargs):
    """Single mode (one sample → float) and batch mode (a session's segments → list of floats)."""
    if isinstance(sample_or_samples, list):
        return [_sample_score(s) for s in sample_or_samples]
    return _sample_score(sample_or_samples)


def _sample_score(sample) -> float:
    if sample.remove_sample:
        return 0.0
    metadata = sample.metadata
    return score(sample.label, metadata.get("city"), metadata.get("final_answer"), metadata.get("tool_calls", []))

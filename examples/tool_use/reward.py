"""Reward of the tool-use task (``--custom-rm-path examples.tool_use.reward.reward``).

1.0 when the episode's final answer is the product *and* the answer came after a ``multiply`` call
with the right operands; 0.0 otherwise. The generate function stores what it saw in each sample's
metadata (``final_answer``, ``tool_calls``); fan-out lists are scored once per list, every segment of
an episode gets the episode's reward.
"""

from __future__ import annotations


def score(label: str, final_answer: str | None, tool_calls: list[dict]) -> float:
    if final_answer is None or final_answer.strip() != str(label):
        return 0.0
    a_times_b = [c for c in tool_calls if c.get("name") == "multiply"
                 and isinstance(c.get("arguments"), dict) and _product(c["arguments"]) == int(label)]
    return 1.0 if a_times_b else 0.0


def _product(arguments: dict) -> int | None:
    a, b = arguments.get("a"), arguments.get("b")
    return a * b if isinstance(a, int) and isinstance(b, int) else None


async def reward(args, sample_or_samples, **kwargs):
    """Single mode (one sample → float) and batch mode (a session's segments → list of floats)."""
    if isinstance(sample_or_samples, list):
        return [_sample_score(s) for s in sample_or_samples]
    return _sample_score(sample_or_samples)


def _sample_score(sample) -> float:
    if sample.remove_sample:
        return 0.0
    return score(sample.label, sample.metadata.get("final_answer"), sample.metadata.get("tool_calls", []))

"""Reward of the tool-use task (``--custom-rm-path examples.tool_use.reward.reward``).

0.5 for calling ``multiply`` with the question's operands (in either order), plus 0.5 when the final
answer is then the product; 0.0 otherwise (no answer without the tool gets credit: the tiny model
cannot multiply, and the point is to learn to use the tool). The generate function stores what it
saw in each sample's metadata (``final_answer``, ``tool_calls``); a fan-out list is scored in one
call and every segment of an episode gets the episode's reward.
"""

from __future__ import annotations


def score(label: str, final_answer: str | None, tool_calls: list[dict]) -> float:
    called_right = any(c.get("name") == "multiply" and isinstance(c.get("arguments"), dict)
                       and _product(c["arguments"]) == int(label) for c in tool_calls)
    if not called_right:
        return 0.0
    answered_right = final_answer is not None and final_answer.strip() == str(label)
    return 1.0 if answered_right else 0.5


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

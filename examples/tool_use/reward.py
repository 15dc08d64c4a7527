"""Reward of the tool-use task (``--custom-rm-path examples.tool_use.reward.reward``).

Three parts, so that a policy that has only begun to learn the task still gets a signal:
0.25 for a well-formed ``get_weather`` call (arguments a JSON object with a string ``city``), another
0.25 when it asks for the city of the question, and 0.5 when the final answer is then that city's
weather (the forecast is only reachable through the tool, so a right answer needs the right lookup).
The generate function stores what it saw in each sample's metadata (``final_answer``,
``tool_calls``, ``city``); a fan-out list is scored in one call and every segment of an episode gets
the episode's reward.
"""

from __future__ import annotations


def score(label: str, city: str, final_answer: str | None, tool_calls: list[dict]) -> float:
    lookups = [c["arguments"]["city"] for c in tool_calls if c.get("name") == "get_weather"
               and isinstance(c.get("arguments"), dict) and isinstance(c["arguments"].get("city"), str)]
    if not lookups:
        return 0.0
    if city not in lookups:
        return 0.25
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

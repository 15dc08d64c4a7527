"""Reward of the shapes task: 1.0 when the response's first digit is the number of squares, else 0.0."""

import re

_DIGIT = re.compile(r"\d")


async def reward(args, sample, **kwargs) -> float:
    match = _DIGIT.search(sample.response or "")
    return 1.0 if match is not None and match.group(0) == str(sample.label).strip() else 0.0

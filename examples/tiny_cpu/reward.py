"""Exact-match reward for the tiny arithmetic task (slime.utils.tiny_task): 1.0 when the response,
stripped of special tokens and whitespace, is the label, else 0.0."""

import re

_SPECIAL = re.compile(r"<\|[^|>]*\|>")


def extract_answer(response: str) -> str:
    return _SPECIAL.sub("", response or "").strip()


async def reward(args, sample, **kwargs) -> float:
    return 1.0 if extract_answer(sample.response) == str(sample.label).strip() else 0.0

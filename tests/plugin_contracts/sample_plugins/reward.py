"""Sample reward plugins (``--custom-rm-path``): single and batched forms."""


async def reward(args, sample, **kwargs) -> float:
    """Reward = fraction of the response that is the letter 'a' (length 4 window), for tests."""
    text = sample.response or ""
    return text[:4].count("a") / 4 if text else 0.25


async def batched_reward(args, samples, **kwargs) -> list[float]:
    """One reward per sample: its response length."""
    return [float(len(s.response or "")) for s in samples]

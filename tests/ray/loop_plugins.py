"""Plugins the end-to-end loop tests name by dotted path (this directory is on the workers' PYTHONPATH)."""

REWARDED_TOKENS = set(range(0, 10_000, 2))


async def even_first_token_reward(args, sample, **kwargs) -> float:
    """1.0 when the first response token id is even: about half of a random model's samples, so
    GRPO has signal from the first step and the reward visibly rises within a few steps."""
    response_tokens = sample.tokens[len(sample.tokens) - sample.response_length:]
    return 1.0 if response_tokens and response_tokens[0] in REWARDED_TOKENS else 0.0

"""The benchmark task of this example: the share of a response's tokens whose id is even.

A random model scores ~0.5; every response token carries signal, so GRPO raises it within a few
steps on the tiny model (the same recipe tests/ray/test_loop.py checks learning with). It needs no
warm start, so a run measures the loop (generation, training, weight pushes), not a curriculum.
"""


async def reward(args, sample, **kwargs) -> float:
    response_tokens = sample.tokens[len(sample.tokens) - sample.response_length:]
    return sum(token % 2 == 0 for token in response_tokens) / len(response_tokens) if response_tokens else 0.0

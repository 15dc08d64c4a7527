"""Rewards that go wrong, named by dotted path in tests/ray/test_mistakes_e2e.py (this directory is on the
workers' PYTHONPATH)."""

import asyncio
import os


async def raising_reward(args, sample, **kwargs):
    raise KeyError("answer")  # e.g. a reward reading a metadata key the data does not have


async def hanging_reward(args, sample, **kwargs):
    marker = os.environ.get("SLIME_TEST_REWARD_STARTED")
    if marker:
        open(marker, "a").close()
    await asyncio.sleep(3600)

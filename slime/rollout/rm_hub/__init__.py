"""Reward models: rule-based scorers by ``--rm-type`` and the custom/remote entry points (docs/INTERFACES.md §3.3).

Dispatch for one sample: ``sample.custom_rm_path`` → ``--custom-rm-path`` → ``metadata["rm_type"]``
→ ``--rm-type``. A ``boxed_`` prefix first replaces the response with the content of its last
``\\boxed{}`` (empty if none) and then applies the base type.
"""

from __future__ import annotations

import asyncio
import inspect
import random

from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.f1 import f1_score
from slime.rollout.rm_hub.gpqa import compute_gpqa_reward
from slime.rollout.rm_hub.ifbench import compute_ifbench_reward
from slime.rollout.rm_hub.math_dapo_utils import compute_score as compute_dapo_score
from slime.rollout.rm_hub.math_utils import compute_math_reward, extract_boxed_answer
from slime.rollout.rm_hub.remote import remote_rm
from slime.utils.misc import load_function

__all__ = ["async_rm", "batched_async_rm", "remote_rm", "RULE_RM_TYPES"]

RULE_RM_TYPES = ("math", "dapo", "deepscaler", "f1", "gpqa", "ifbench", "reasoning_gym", "remote_rm", "random")


async def call_reward_function(path: str, *call_args, **kwargs):
    """Call the reward hook at ``path``: ``async def`` is awaited, a plain ``def`` runs in a worker thread
    (so a slow one neither blocks the event loop nor escapes ``--reward-timeout``)."""
    fn = load_function(path)
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return await fn(*call_args, **kwargs)
    result = await asyncio.to_thread(fn, *call_args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def _rule_reward(rm_type: str, response: str, label, metadata: dict):
    if rm_type == "math":
        return compute_math_reward(response, label)
    if rm_type == "dapo":
        return compute_dapo_score(response, label)
    if rm_type == "deepscaler":
        return get_deepscaler_rule_based_reward(response, label)
    if rm_type == "f1":
        return f1_score(response, label)[0]
    if rm_type == "gpqa":
        return compute_gpqa_reward(response, label, metadata=metadata)
    if rm_type == "ifbench":
        return compute_ifbench_reward(response, label, metadata=metadata)
    if rm_type == "reasoning_gym":  # the gym's own verifier for rows of slime.rollout.reasoning_gym
        from slime.rollout.reasoning_gym import score

        return score(response, metadata)
    if rm_type == "random":
        return random.randint(0, 1)
    raise NotImplementedError(f"rm_type {rm_type!r} is not implemented; known types: {list(RULE_RM_TYPES)}")


async def async_rm(args, sample, **kwargs):
    """Reward of one sample (custom RM if configured, else the rule RM named by its type)."""
    custom_rm_path = getattr(sample, "custom_rm_path", None) or args.custom_rm_path
    if custom_rm_path:
        return await call_reward_function(custom_rm_path, args, sample, **kwargs)

    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    if not rm_type:
        raise NotImplementedError("rm_type not specified: set --rm-type, metadata['rm_type'] or --custom-rm-path")
    response = sample.response
    if rm_type.startswith("boxed_"):
        response = extract_boxed_answer(response) or ""
        rm_type = rm_type[len("boxed_") :]
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    return _rule_reward(rm_type, response, sample.label, metadata)


async def batched_async_rm(args, samples, **kwargs) -> list:
    """Rewards of a list of samples: one ``--custom-rm-path`` call with the list, else per-sample rule RMs."""
    custom_rm_path = args.custom_rm_path
    if custom_rm_path:
        rewards = await call_reward_function(custom_rm_path, args, samples, **kwargs)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            raise TypeError(
                f"batched reward {custom_rm_path} must return a list of {len(samples)} rewards, got {rewards!r:.200}"
            )
        return list(rewards)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))

"""Per-sample post-generation hooks (``--rollout-sample-hook-path``, docs/INTERFACES.md §2.18).

Each hook ``hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None`` (sync or
async) runs, in the order given, on every ``Sample`` leaf of a generate result, after generation
and before the reward. Returning a Sample replaces the leaf; None keeps it.

The current rollout step is published by the rollout manager with
:func:`set_current_rollout_id` so hooks see ``rollout_id`` without it being threaded through every
generate function.
"""

from __future__ import annotations

import inspect

from slime.utils.misc import load_function
from slime.utils.types import Sample

_current_rollout_id: int | None = None


def set_current_rollout_id(rollout_id: int | None) -> None:
    """Publish the rollout step that hooks receive as ``rollout_id`` by default."""
    global _current_rollout_id
    _current_rollout_id = rollout_id


def get_current_rollout_id() -> int | None:
    return _current_rollout_id


def _accepted_kwargs(hook, kwargs: dict) -> dict:
    try:
        params = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


async def _apply_one(hook, path: str, args, value, kwargs):
    if isinstance(value, list):
        return [await _apply_one(hook, path, args, item, kwargs) for item in value]
    result = hook(args, value, **_accepted_kwargs(hook, kwargs))
    if inspect.isawaitable(result):
        result = await result
    if result is None:
        return value
    if isinstance(result, Sample):
        return result
    raise TypeError(f"rollout sample hook {path} returned {type(result).__name__}; expected Sample or None")


async def apply_rollout_sample_hooks(args, value, **kwargs):
    """Run every configured hook over the Sample leaves of ``value`` (a Sample or nested list)."""
    paths = args.rollout_sample_hook_path or []
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        return value
    kwargs.setdefault("rollout_id", _current_rollout_id)
    kwargs.setdefault("evaluation", False)
    for path in paths:
        value = await _apply_one(load_function(path), path, args, value, kwargs)
    return value

"""Containers returned by rollout functions (docs/INTERFACES.md §2.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    """What a training rollout returns.

    samples: one inner list per prompt group (deeper nesting under fan-out; any depth is flattened).
    metrics: extra scalars logged verbatim with the rollout (e.g. ``rollout/dynamic_filter/drop_x``).
    """

    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """What an evaluation rollout returns.

    data: ``{dataset_name: {"rewards": [float], "truncated": [bool], "samples": [Sample]}}``, the
    three lists of equal length.
    metrics: extra scalars logged with the evaluation.
    """

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn, *args, evaluation: bool, **kwargs):
    """Call a rollout function and wrap legacy raw returns into the output containers."""
    result = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(result, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        return result
    if evaluation:
        return RolloutFnEvalOutput(data=result)
    return RolloutFnTrainOutput(samples=result)

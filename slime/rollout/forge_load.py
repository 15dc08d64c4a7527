"""Replay rollout (docs/INTERFACES.md §3.1): serve dumped samples as the step's rollout, engines kept alive.

``--rollout-function-path slime.rollout.forge_load.generate_rollout --load-forge-rollout-data PATH`` reads
dumps in the format of ``--save-debug-rollout-data`` (docs/INTERFACES.md §7.5: ``{"rollout_id", "samples": [Sample.to_dict()]}``).
PATH is a template with ``{rollout_id}`` (one dump a step; a step with no dump of its own replays step 0's)
or a literal path replayed every step. Unlike ``--load-debug-rollout-data``, the engines are started and
weights are still pushed to them, so the loop runs as it would with generation — useful to train, time or
debug the trainer and the weight update on a fixed batch. Evaluation replays ``eval_<id>`` dumps (the
template's, or ``eval_<id>.pt`` beside a literal path) as one dataset, ``forge_eval``; it is empty without one.
"""

from __future__ import annotations

import logging
import os

import torch

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

EVAL_DATASET = "forge_eval"


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    template = args.load_forge_rollout_data
    if not template:
        raise ValueError("slime.rollout.forge_load.generate_rollout needs --load-forge-rollout-data (a dump path, "
                         "optionally with {rollout_id}; the format of --save-debug-rollout-data)")
    if evaluation:
        path = _format(template, f"eval_{rollout_id}") or os.path.join(os.path.dirname(template), f"eval_{rollout_id}.pt")
        if not os.path.isfile(path):
            return RolloutFnEvalOutput(data={})
        samples = _load(path)
        return RolloutFnEvalOutput(data={EVAL_DATASET: {
            "rewards": [sample.get_reward_value(args) for sample in samples],
            "truncated": [sample.status == Sample.Status.TRUNCATED for sample in samples],
            "samples": samples,
        }})
    path = _format(template, rollout_id) or template
    if not os.path.isfile(path):
        first = _format(template, 0)
        if first is None or not os.path.isfile(first):
            raise FileNotFoundError(f"--load-forge-rollout-data: no dump for rollout {rollout_id} at {path}")
        logger.info("--load-forge-rollout-data: no dump at %s, replaying step 0's (%s)", path, first)
        path = first
    return RolloutFnTrainOutput(samples=_load(path))


def _format(template: str, rollout_id) -> str | None:
    """``template`` with ``{rollout_id}`` filled, or None for a literal path."""
    return template.format(rollout_id=rollout_id) if "{rollout_id}" in template else None


def _load(path: str) -> list[Sample]:
    try:
        payload = torch.load(path, weights_only=False)
        return [Sample.from_dict(d) for d in payload["samples"]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"--load-forge-rollout-data: {path} is not a rollout dump (expected "
                         f"{{'rollout_id': int, 'samples': [Sample.to_dict(), ...]}}): {exc!r}") from exc

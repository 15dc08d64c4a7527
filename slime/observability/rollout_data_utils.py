"""Rollout debug dumps (docs/INTERFACES.md §7.5): save every rollout step's samples, replay them later.

``torch.save({"rollout_id": id, "samples": [Sample.to_dict(), ...]})`` at
``template.format(rollout_id=id)`` (``eval_<id>`` for evaluation).
"""

from __future__ import annotations

import os

import torch

from slime.utils.types import Sample


def save_debug_rollout_data(path_template: str, data: list[Sample], *, rollout_id: int, evaluation: bool) -> str:
    key = f"eval_{rollout_id}" if evaluation else rollout_id
    path = path_template.format(rollout_id=key)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": [sample.to_dict() for sample in data]}, path)
    return path


def load_debug_rollout_data(path_template: str, *, rollout_id: int, subsample_ratio: float | None = None) -> list[Sample]:
    path = path_template.format(rollout_id=rollout_id)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load-debug-rollout-data: no dump for rollout {rollout_id} at {path}")
    payload = torch.load(path, weights_only=False)
    samples = [Sample.from_dict(d) for d in payload["samples"]]
    if subsample_ratio is not None:
        keep = int(subsample_ratio * len(samples)) // 2
        samples = samples[:keep] + (samples[-keep:] if keep else [])
    return samples

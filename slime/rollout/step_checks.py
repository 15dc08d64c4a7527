"""A training step that cannot teach anything stops the run: every sample failed (a reward that cannot
run, an engine refusing every request) or every sample was filtered out of training."""

from __future__ import annotations

from slime.utils.errors import UserError
from slime.utils.types import Sample

__all__ = ["RunCannotLearn", "check_step_can_learn"]


class RunCannotLearn(UserError):
    """Raised by the rollout manager; ``train.py`` reports it in one message (exit 1)."""


def _failure_reason(sample: Sample) -> str:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    for key in ("reward_error", "generate_error"):
        if metadata.get(key):
            return f"{key}: {metadata[key]}"
    return "no reason recorded (the generate function set Sample.Status.FAILED)"


def check_step_can_learn(args, samples: list[Sample], rollout_id: int) -> None:
    """Raise :class:`RunCannotLearn` when ``--stop-on-failed-ratio`` of the step's samples FAILED (naming
    the first failure's reason), or when every sample is marked ``remove_sample``."""
    if not samples:
        raise RunCannotLearn(f"rollout step {rollout_id} produced no samples: every prompt was filtered out "
                             f"(check --dynamic-sampling-filter-path / the rollout function)")
    failed = [s for s in samples if s.status == Sample.Status.FAILED]
    threshold = args.stop_on_failed_ratio
    if failed and len(failed) >= threshold * len(samples):
        raise RunCannotLearn(
            f"rollout step {rollout_id}: {len(failed)} of {len(samples)} samples FAILED (--stop-on-failed-ratio "
            f"{threshold:g}), so the run cannot learn and stops. First failure (sample {failed[0].index}): "
            f"{_failure_reason(failed[0])}")
    if all(s.remove_sample for s in samples):
        raise RunCannotLearn(f"rollout step {rollout_id}: every one of {len(samples)} samples was marked remove_sample "
                             f"(--rollout-sample-filter-path {args.rollout_sample_filter_path}): "
                             f"nothing would be trained on")

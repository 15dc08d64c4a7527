"""Sample hook plugins: per-sample hook, sample filter, all-samples process, log hooks, request-mode generate."""

import asyncio

from slime.utils.types import Sample


def tag_sample(args, sample, *, rollout_id=None, evaluation=False):
    """``--rollout-sample-hook-path``: records the rollout step it ran in."""
    sample.metadata["hooked_rollout_id"] = rollout_id
    sample.metadata["hooked_evaluation"] = evaluation
    return None


async def replace_sample(args, sample, **kwargs):
    """An async hook that returns a replacement Sample."""
    replacement = Sample.from_dict(sample.to_dict())
    replacement.metadata["replaced"] = True
    return replacement


def bad_hook(args, sample):
    return 42


def remove_odd(args, groups):
    """``--rollout-sample-filter-path``: drops (from training) every sample with an odd index."""
    for group in groups:
        for sample in group:
            sample.remove_sample = sample.index % 2 == 1


def record_all(args, all_groups, data_source):
    """``--rollout-all-samples-process-path``: remembers the first index of every finished group."""
    args.recorded_all_groups = [group[0].index for group in all_groups]


def rollout_log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """``--custom-rollout-log-function-path``: suppresses default logging for even steps."""
    args.logged_rollouts = getattr(args, "logged_rollouts", []) + [(rollout_id, len(samples))]
    return rollout_id % 2 == 0


def eval_log(rollout_id, args, data, extra_metrics):
    """``--custom-eval-rollout-log-function-path``: suppresses default eval logging."""
    args.logged_evals = getattr(args, "logged_evals", []) + [(rollout_id, sorted(data))]
    return True


async def request_mode_generate(args, sample, sampling_params):
    """A generate function aborted per request: slow for prompt 'b', cancelled on rollout abort."""
    if "b" in str(sample.prompt):
        await asyncio.sleep(30)
    sample.tokens = [1, 2, 3]
    sample.response_length = 1
    sample.response = "x"
    sample.loss_mask = [1]
    sample.rollout_log_probs = [-0.1]
    sample.status = Sample.Status.COMPLETED
    return sample


request_mode_generate.abort_mode = "request"

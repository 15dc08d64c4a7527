"""Sample generate plugins (``--custom-generate-function-path``)."""

import copy

from slime.rollout.sglang_rollout import generate as default_generate


async def generate(args, sample, sampling_params, evaluation=False):
    """Delegates to the default generator and records that it ran (and whether in evaluation)."""
    sample = await default_generate(args, sample, sampling_params, evaluation=evaluation)
    sample.metadata["custom_generate"] = {"evaluation": evaluation}
    return sample


async def fanout_generate(args, sample, sampling_params):
    """Generates once, then emits two segments sharing one rollout_id (a tool-call style split)."""
    sample = await default_generate(args, sample, sampling_params)
    second = copy.deepcopy(sample)
    sample.rollout_id = second.rollout_id = sample.index
    second.metadata["segment"] = 1
    sample.metadata["segment"] = 0
    return [sample, second]

"""Sample ``--rollout-function-path`` / ``--eval-function-path``: wraps the default rollout and adds a metric."""

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.sglang_rollout import generate_rollout as default_generate_rollout


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    output = default_generate_rollout(args, rollout_id, data_source, evaluation=evaluation)
    metrics = dict(output.metrics or {})
    metrics["custom/rollout_id"] = rollout_id
    if evaluation:
        return RolloutFnEvalOutput(data=output.data, metrics=metrics)
    return RolloutFnTrainOutput(samples=output.samples, metrics=metrics)

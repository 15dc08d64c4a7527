"""Sample dynamic-sampling filter and buffer filter."""

from slime.rollout.filter_hub.base_types import DynamicFilterOutput


def keep_if_any_correct(args, samples, **kwargs):
    """``--dynamic-sampling-filter-path``: keep a group when at least one reward is positive."""
    rewards = [s.get_reward_value(args) for s in samples]
    if any(r > 0 for r in rewards):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason="all_wrong")


def pop_last(args, rollout_id, buffer, num_samples):
    """``--buffer-filter-path``: serve the most recently added groups first (LIFO)."""
    taken = []
    while buffer and len(taken) < num_samples:
        taken.append(buffer.pop())
    return taken

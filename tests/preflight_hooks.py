"""Hooks, right and wrong, that the start-up checks are tried on (tests/test_preflight.py)."""

NOT_A_FUNCTION = 42


async def async_reward(args, sample, **kwargs):
    return 1.0


def sync_reward(args, sample, **kwargs):
    return 0.5


async def reward_without_sample(args):
    return 1.0


def plain_generate(args, sample, sampling_params, evaluation=False):
    return sample


async def async_generate(args, sample, sampling_params, evaluation=False):
    return sample


def rollout_without_data_source(args, rollout_id):
    return []


def rollout_fn(args, rollout_id, data_source, evaluation=False):
    return []


def loss_with_two_args(args, batch):
    return 0


def buffer_filter(args, rollout_id, buffer, num_samples):
    return []


class DataSourceWithoutArgs:
    def __init__(self):
        pass


def sample_hook(args, sample, *, rollout_id=None, evaluation=False):
    return None

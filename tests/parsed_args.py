"""slime's parsed arguments for tests that call code taking ``args``: the parser's defaults, never a second
copy of them in a hand-made namespace."""

from __future__ import annotations

import argparse
import copy
import functools

#: the smallest command line slime accepts, on CPU (the FSDP backend, the embedded engine)
BASE_ARGV = ("--rollout-batch-size", "1", "--num-rollout", "1", "--train-backend", "fsdp",
             "--rollout-backend", "embedded")


@functools.lru_cache(maxsize=1)
def _parsed() -> argparse.Namespace:
    from slime.arguments import parse_args

    return parse_args(list(BASE_ARGV))


def default_args(**overrides) -> argparse.Namespace:
    """A fresh copy of the parsed defaults, with ``overrides`` set as they are (no validation reruns)."""
    args = copy.deepcopy(_parsed())
    for name, value in overrides.items():
        setattr(args, name, value)
    return args

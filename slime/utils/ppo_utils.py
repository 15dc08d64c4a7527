"""The algorithms' public path (docs/INTERFACES.md names ``slime.utils.ppo_utils``): the same module as
:mod:`slime.algorithms.functional`."""

import sys

from slime.algorithms import functional as _functional

sys.modules[__name__] = _functional

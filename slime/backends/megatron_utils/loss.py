"""Loss-side built-ins under the module path users name on the command line (docs/INTERFACES.md §3.5).

``--custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function`` and the default
``vanilla_tis_function`` live in :mod:`slime.algorithms.functional`; this module re-exports them and
imports no Megatron code, so the paths resolve on any machine and with either training backend.
"""

from slime.algorithms.functional import icepop_function, sum_of_sample_mean, vanilla_tis_function

__all__ = ["vanilla_tis_function", "icepop_function", "sum_of_sample_mean"]

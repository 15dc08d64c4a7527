"""The start-up checks' public path (docs/INTERFACES.md names ``slime.utils.preflight.UserError``): the same
module as :mod:`slime.preflight`, which resolves hooks and rewards."""

import sys

from slime import preflight as _preflight

sys.modules[__name__] = _preflight

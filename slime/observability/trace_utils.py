"""The trace helpers under the observability package: the same module as :mod:`slime.utils.trace_utils`
(docs/INTERFACES.md names both paths), so either import path sees one state."""

import sys

from slime.utils import trace_utils as _trace_utils

sys.modules[__name__] = _trace_utils

"""Old home of the trace helpers (seed docs, slime ≤ v0.3.1): the same module as
:mod:`slime.observability.trace_utils` (docs/INTERFACES.md §0 row 4), so either import path sees one state."""

import sys

from slime.observability import trace_utils as _trace_utils

sys.modules[__name__] = _trace_utils

"""A hook module that fails on import (its own bug), for tests/utils/test_preflight.py."""

raise RuntimeError("this module is broken on purpose")

"""A hook module that fails on import (its own bug), for tests/test_preflight.py."""

raise RuntimeError("this module is broken on purpose")

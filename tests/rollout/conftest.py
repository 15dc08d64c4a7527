"""Fixtures of the rollout tests (the tiny model comes from tests/conftest.py)."""




"""Fixtures of the rollout tests: the tiny model (built once per session) and the stand-in engine."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(out, size="tiny", seed=0)
    return str(out)

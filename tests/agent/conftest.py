"""Fixtures of the agent-adapter tests: the tiny model taught the tool-use script of
``agent_script.py``, served by the embedded engine for the whole session."""

import pytest

from agent_script import teach_script


@pytest.fixture(scope="session")
def scripted_model_dir(tiny_model_dir, tmp_path_factory):
    return str(teach_script(tiny_model_dir, tmp_path_factory.mktemp("agent") / "scripted_model"))


@pytest.fixture(scope="session")
def engine(scripted_model_dir):
    from slime.backends.embedded_engine.serving.launch import running_engine

    with running_engine(scripted_model_dir, extra_args=["--context-length", "1024"]) as proc:
        yield proc


@pytest.fixture(scope="session")
def tokenizer(scripted_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scripted_model_dir)


LONG_CONTEXT = 8192  # the coding-agent CLIs' prompts (2.6-3.4k tokens of this tokenizer with trimmed tools)


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory):
    """The tiny model with an 8192-token context (untrained: its replies never end within a small budget)."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("long_model"), size="tiny", seed=0,
                                max_position_embeddings=LONG_CONTEXT))


@pytest.fixture(scope="session")
def long_engine(long_model_dir):
    from slime.backends.embedded_engine.serving.launch import running_engine

    with running_engine(long_model_dir, extra_args=["--context-length", str(LONG_CONTEXT)]) as proc:
        yield proc

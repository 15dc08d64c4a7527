"""Fixtures of the agent-adapter tests: the tiny model taught the tool-use script of
``agent_script.py``, served by the embedded engine for the whole session."""

import pytest

from agent_script import teach_script


@pytest.fixture(scope="session")
def scripted_model_dir(tiny_model_dir, tmp_path_factory):
    return str(teach_script(tiny_model_dir, tmp_path_factory.mktemp("agent") / "scripted_model"))


@pytest.fixture(scope="session")
def engine(scripted_model_dir):
    from slime.backends.embedded_engine.launch import running_engine

    with running_engine(scripted_model_dir, extra_args=["--context-length", "1024"]) as proc:
        yield proc


@pytest.fixture(scope="session")
def tokenizer(scripted_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scripted_model_dir)

"""Shared fixtures: a tiny Qwen3 checkpoint and task data built once per test session."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_task_data(tmp_path_factory):
    from slime.utils.tiny_task import build_task_data

    return build_task_data(tmp_path_factory.mktemp("tiny_task"), seed=0, num_train=64, num_eval=16, num_sft=64)

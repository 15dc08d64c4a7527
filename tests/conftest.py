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


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA with q/kv LoRA and YaRN; 8 routed experts + 1 shared, sigmoid routing
    with an expert bias, 2 groups of which 1 is kept; a dense first layer), ~1.4M parameters."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_deepseek_v3"), size="tiny", seed=0, arch="deepseek_v3"))


@pytest.fixture(scope="session")
def tiny_glm4_moe_dir(tmp_path_factory):
    """A tiny GLM-4.5 (GQA with partial rotary, qkv bias and qk-norm; the same sigmoid MoE), ~1.5M parameters."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_glm4_moe"), size="tiny", seed=0, arch="glm4_moe"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (softmax top-2 of 8 experts in every layer, no shared expert)."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), size="tiny", seed=0, arch="qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory):
    """A tiny Qwen3.5 language model: gated-DeltaNet linear attention in layers 0-2, gated softmax attention in 3."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_5"), size="tiny", seed=0, arch="qwen3_5"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tmp_path_factory):
    """Its MoE variant: softmax top-2 of 8 experts and a sigmoid-gated shared expert in every layer."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_5_moe"), size="tiny", seed=0, arch="qwen3_5_moe"))


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory):
    """A tiny Qwen3-Next: Qwen3.5-MoE's layers with grouped q/k/v/z and b/a projections in its linear attention."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_next"), size="tiny", seed=0, arch="qwen3_next"))


@pytest.fixture(scope="session")
def tiny_glm4_dir(tmp_path_factory):
    """A tiny GLM-4 dense model: norms after the attention and the MLP too, interleaved rotary on half of each head."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_glm4"), size="tiny", seed=0, arch="glm4"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL (2-block vision tower, 14-pixel patches merged 2x2; the tiny Qwen3's text shape)."""
    from slime.utils.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), arch="qwen2_5_vl", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory):
    """A tiny Qwen3-VL (interleaved M-RoPE, deepstack features from the first vision block)."""
    from slime.utils.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen3_vl"), arch="qwen3_vl", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe_dir(tmp_path_factory):
    """Its MoE variant (Qwen3-VL-MoE): softmax top-2 of 8 experts in every layer, no shared expert."""
    from slime.utils.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen3_vl_moe"), arch="qwen3_vl_moe", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen3_5_vl_dir(tmp_path_factory):
    """A tiny Qwen3.5 with its vision tower: the hybrid language model (gated-DeltaNet linear attention in layers
    0-2, gated softmax attention in 3), interleaved M-RoPE on a quarter of each head, no deepstack."""
    from slime.utils.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen3_5_vl"), arch="qwen3_5", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_vl_dir(tmp_path_factory):
    """Its MoE variant with the vision tower: top-2 of 8 experts and a shared expert in every layer."""
    from slime.utils.tiny_vlm import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen3_5_moe_vl"), arch="qwen3_5_moe", seed=0))

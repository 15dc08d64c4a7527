"""Fused q/k/v and gate/up projections (``fused_projections.py``): the fused model's logits equal the
unfused model's for every family it knows, and the Hugging Face names keep reaching the fused storage
(weight updates, reads, byte count), also after the parameters are moved (memory saver)."""

from __future__ import annotations

import copy

import pytest
import torch

from slime.backends.embedded_engine.kernels import fused_projections

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _config(family: str):
    from transformers import (LlamaConfig, MistralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    return {"llama": lambda: LlamaConfig(**TINY, mlp_bias=True),
            "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
            "qwen2": lambda: Qwen2Config(**TINY),  # q/k/v biases
            "qwen2_moe": lambda: Qwen2MoeConfig(**TINY, **moe, shared_expert_intermediate_size=24),
            "qwen3": lambda: Qwen3Config(**TINY),
            "qwen3_moe": lambda: Qwen3MoeConfig(**TINY, **moe, mlp_only_layers=[0])}[family]()


def _models(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(family)
    config._attn_implementation = "sdpa"
    reference = AutoModelForCausalLM.from_config(config).eval()
    for parameter in reference.parameters():  # biases start at zero: make them count
        torch.nn.init.normal_(parameter.data, std=0.2)
    return reference, copy.deepcopy(reference)


# fused MLPs per model: dense MLPs, Qwen2-MoE's shared experts, Qwen3-MoE's dense (mlp_only) layer
GATE_UP = {"llama": 2, "mistral": 2, "qwen2": 2, "qwen2_moe": 2, "qwen3": 2, "qwen3_moe": 1}


@pytest.mark.parametrize("family", list(GATE_UP))
def test_fused_model_logits_equal_the_unfused_model(family):
    reference, fused = _models(family)
    counts = fused_projections.install(fused)
    assert counts == {"qkv": 2, "gate_up": GATE_UP[family]}
    attention = fused.model.layers[0].self_attn
    assert not hasattr(attention, "q_proj") and attention.qkv_proj.weight.shape[0] == (4 + 2 + 2) * 8
    if family == "qwen2":
        assert attention.qkv_proj.bias is not None
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    # the byte count of the parameters is the same: the fused weights replace the separate ones
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.bias",
                                  "model.layers.1.mlp.up_proj.weight"])
def test_projection_slice_is_the_hf_tensor_and_writes_through(name):
    reference, fused = _models("qwen2")
    fused_projections.install(fused)
    view = fused_projections.projection_slice(fused, name)
    expected = dict(reference.named_parameters())[name]
    assert torch.equal(view, expected)
    with torch.no_grad():
        view.fill_(0.5)
        dict(reference.named_parameters())[name].fill_(0.5)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert fused_projections.projection_slice(fused, "model.layers.0.self_attn.o_proj.weight") is None
    assert fused_projections.projection_slice(fused, "model.layers.9.self_attn.q_proj.weight") is None


def test_runner_updates_by_hf_name_reach_the_fused_weights_after_a_move(tiny_model_dir):
    """The engine's runner fuses the tiny Qwen3; an update of ``q_proj.weight`` by name, read back by
    name, and the logits equal HF's (unfused) with the same weights, also after the parameters have
    been rebound by ``model.to()`` (what release/resume of the memory saver does on CUDA)."""
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner
    from engine_test_utils import load_hf

    runner = ModelRunner(tiny_model_dir, num_slots=2, slot_capacity=64)
    hf = load_hf(tiny_model_dir)
    layers = hf.config.num_hidden_layers
    assert runner.fused_projections == {"qkv": layers, "gate_up": layers}
    assert runner.weight_bytes() == sum(p.numel() * p.element_size() for p in hf.parameters())
    runner.model.to(torch.float64).to(torch.float32)  # rebinds every param.data, as .to("cpu")/.to("cuda") do

    name = "model.layers.1.self_attn.q_proj.weight"
    new = torch.randn(hf.get_parameter(name).shape, generator=torch.Generator().manual_seed(3)) * 0.1
    assert runner.load_named_tensors([(name, new)]) == 1
    with torch.no_grad():
        hf.get_parameter(name).copy_(new)
    assert torch.equal(runner.get_weight(name), new)
    assert torch.equal(runner.get_weight("model.layers.1.mlp.gate_proj.weight"),
                       hf.get_parameter("model.layers.1.mlp.gate_proj.weight"))

    prompt = [5, 17, 33, 2, 91, 40]
    logits, _ = runner.forward([0], [ForwardRow(prompt, 0)])
    step = runner.decode([int(logits[0].argmax())], [len(prompt)])
    with torch.no_grad():
        want = hf(torch.tensor([prompt + [int(logits[0].argmax())]])).logits[0]
    torch.testing.assert_close(logits[0], want[-2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step[0], want[-1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="q_proj.weight"):
        runner.load_named_tensors([(name, new[:-1])])


def test_fp8_fuses_only_whole_weight_blocks(tiny_model_dir):
    """Under FP8 a group is fused only where every part is whole 128-row blocks: the tiny model's
    gate/up (384 rows each) are, its k/v (64 rows) are not, so q/k/v stay separate."""
    from slime.backends.embedded_engine.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir, num_slots=2, slot_capacity=64, quantization="fp8")
    layers = runner.model.config.num_hidden_layers
    assert runner.fused_projections == {"qkv": 0, "gate_up": layers}
    assert hasattr(runner.model.model.layers[0].self_attn, "q_proj")
    assert type(runner.model.model.layers[0].mlp.gate_up_proj).__name__ == "Fp8Linear"


@pytest.mark.gpu
def test_cuda_runner_update_after_release_and_resume_equals_hf(tiny_model_dir):
    """On CUDA (fused projections + fused kernels + graphs): release and resume the weights, update
    ``q_proj.weight`` by name, and the graph-replayed decode equals HF fp32 with the same weights."""
    from slime.backends.embedded_engine.model_runner import ForwardRow, ModelRunner
    from engine_test_utils import load_hf

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner = ModelRunner(tiny_model_dir, device="cuda", dtype="float32", num_slots=4, slot_capacity=64)
    assert runner.fused_projections["qkv"] > 0 and runner.fused_ops.get("mlp", 0) > 0
    hf = load_hf(tiny_model_dir).to("cuda")
    runner.release_weights()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in runner.model.parameters())  # pinned: fast both ways
    runner.resume_weights()
    name = "model.layers.0.self_attn.q_proj.weight"
    new = torch.randn(hf.get_parameter(name).shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3)) * 0.1
    runner.load_named_tensors([(name, new)])
    with torch.no_grad():
        hf.get_parameter(name).copy_(new)
    prompt = [5, 17, 33, 2, 91, 40]
    logits, _ = runner.forward([0], [ForwardRow(prompt, 0)])
    token = int(logits[0].argmax())
    captures = runner.graphs.captures  # the start's graphs went with the weights' move: the step records its own
    step = runner.decode([token], [len(prompt)])
    assert runner.graphs.captures == captures + 1
    with torch.no_grad():
        want = hf(torch.tensor([prompt + [token]], device="cuda")).logits[0]
    torch.testing.assert_close(step[0], want[-1], atol=1e-4, rtol=1e-4)

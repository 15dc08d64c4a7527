"""HF <-> Megatron name mappings on tiny random checkpoints of each family (CPU, no Megatron needed)."""

import pytest
import torch

from slime.backends.megatron_utils import weight_mapping as wm


def _tiny_checkpoint(tmp_path, model_type: str, tie: bool = False) -> tuple[dict, dict]:
    """(config dict, checkpoint-format state dict) of a randomly initialised tiny HF model."""
    import transformers
    from safetensors.torch import load_file

    common = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tie)
    if model_type == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    elif model_type == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(config)
    elif model_type == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                             mlp_only_layers=[0], **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif model_type == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                                             num_experts_per_tok=2, **common)
        model = transformers.Qwen2MoeForCausalLM(config)
    elif model_type == "deepseek_v3":
        common.update(num_hidden_layers=3, num_key_value_heads=4)
        config = transformers.DeepseekV3Config(
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, **common)
        model = transformers.DeepseekV3ForCausalLM(config)
    elif model_type == "glm4_moe":
        config = transformers.Glm4MoeConfig(head_dim=8, moe_intermediate_size=16, n_routed_experts=4,
                                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                            attention_bias=True, use_qk_norm=True, **common)
        model = transformers.Glm4MoeForCausalLM(config)
    elif model_type == "glm4":  # post-attention / post-MLP norms, HF's fused gate_up_proj
        config = transformers.Glm4Config(head_dim=8, attention_bias=True, pad_token_id=0, **common)
        model = transformers.Glm4ForCausalLM(config)
    else:
        raise AssertionError(model_type)
    torch.manual_seed(0)
    for p in list(model.parameters()) + [b for n, b in model.named_buffers() if "e_score" in n]:
        torch.nn.init.normal_(p)  # norms start at 1, biases at 0: randomise so a swap would show
    model.save_pretrained(tmp_path / model_type)
    return config.to_dict(), load_file(str(tmp_path / model_type / "model.safetensors"))


FAMILIES = ["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "glm4"]


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("te_fused_norms", [False, True])
def test_round_trip_is_bit_exact_and_covers_every_tensor(tmp_path, model_type, te_fused_norms):
    config, hf_state = _tiny_checkpoint(tmp_path, model_type)
    layout = wm.ModelLayout.from_hf_config(config, make_vocab_size_divisible_by=64, te_fused_norms=te_fused_norms)
    assert layout.padded_vocab_size == 128
    megatron = wm.hf_to_megatron(hf_state, layout)
    assert list(megatron) == wm.megatron_param_names(layout)
    assert megatron["embedding.word_embeddings.weight"].shape == (128, 32)
    assert torch.equal(megatron["embedding.word_embeddings.weight"][100:], torch.zeros(28, 32))
    back = wm.megatron_to_hf(megatron, layout)
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert sorted(wm.hf_param_names(layout)) == sorted(hf_state)


def test_tied_embeddings_have_no_output_layer(tmp_path):
    config, hf_state = _tiny_checkpoint(tmp_path, "qwen3", tie=True)
    assert "lm_head.weight" not in hf_state
    layout = wm.ModelLayout.from_hf_config(config)
    megatron = wm.hf_to_megatron(hf_state, layout)
    assert "output_layer.weight" not in megatron
    # a pipeline's last stage holds a copy as output_layer.weight; exporting it adds nothing
    assert wm.megatron_to_hf_tensors("output_layer.weight", megatron["embedding.word_embeddings.weight"], layout) == []


def test_qkv_is_ordered_per_query_group():
    layout = wm.ModelLayout("qwen3", num_layers=1, hidden_size=8, num_attention_heads=4, num_query_groups=2, head_dim=2,
                            vocab_size=8, padded_vocab_size=8)
    # head h of q is filled with 10+h, k group g with 20+g, v group g with 30+g
    q = torch.cat([torch.full((2, 8), 10.0 + h) for h in range(4)])
    k = torch.cat([torch.full((2, 8), 20.0 + g) for g in range(2)])
    v = torch.cat([torch.full((2, 8), 30.0 + g) for g in range(2)])
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}
    qkv = wm.hf_to_megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__, layout)
    rows = qkv[::2, 0].tolist()  # one value per head-sized block
    assert rows == [10, 11, 20, 30, 12, 13, 21, 31]


def test_moe_layout_follows_the_config(tmp_path):
    config, hf_state = _tiny_checkpoint(tmp_path, "qwen3_moe")
    layout = wm.ModelLayout.from_hf_config(config)
    assert layout.moe_layers == (False, True) and layout.num_experts == 4 and not layout.shared_expert
    names = wm.megatron_param_names(layout)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in names
    grouped = wm.ModelLayout.from_hf_config(config, grouped_experts=True)
    megatron = wm.hf_to_megatron(hf_state, grouped)
    assert torch.equal(megatron["decoder.layers.1.mlp.experts.linear_fc1.weight2"],
                       torch.cat([hf_state["model.layers.1.mlp.experts.2.gate_proj.weight"],
                                  hf_state["model.layers.1.mlp.experts.2.up_proj.weight"]]))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen2_moe"])
def test_tensor_parallel_split_and_merge(tmp_path, model_type):
    config, hf_state = _tiny_checkpoint(tmp_path, model_type)
    layout = wm.ModelLayout.from_hf_config(config, make_vocab_size_divisible_by=64, tp_size=2)
    megatron = wm.hf_to_megatron(hf_state, layout)
    for name, full in megatron.items():
        shards = wm.tp_split(name, full, 2)
        assert torch.equal(wm.tp_merge(name, shards), full), name
    # SwiGLU fc1: rank r holds [gate_r; up_r]
    gate = hf_state["model.layers.0.mlp.gate_proj.weight"] if model_type == "qwen2" else \
        hf_state["model.layers.0.mlp.shared_expert.gate_proj.weight"]
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight" if model_type == "qwen2" else \
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"
    rank1 = wm.tp_split(fc1, megatron[fc1], 2)[1]
    assert torch.equal(rank1[: gate.shape[0] // 2], gate[gate.shape[0] // 2:])
    # QKV: rank r holds whole query groups (q heads, k, v of group r)
    qkv = wm.tp_split("decoder.layers.0.self_attention.linear_qkv.weight", megatron["decoder.layers.0.self_attention.linear_qkv.weight"], 2)
    k_group1 = hf_state["model.layers.0.self_attn.k_proj.weight"][8:]
    assert torch.equal(qkv[1][16:24], k_group1)
    assert wm.tp_kind("decoder.layers.0.self_attention.linear_proj.weight") == "row"
    assert wm.tp_kind("decoder.layers.0.mlp.router.weight") == "replicated"
    assert wm.tp_kind("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight") == "row"


def test_pipeline_and_expert_renaming():
    assert wm.pp_layer_range(8, 2, 1) == (4, 8)
    assert wm.pp_layer_range(10, 3, 0, first=2) == (0, 2)
    assert wm.pp_layer_range(10, 3, 2, first=2) == (6, 10)
    with pytest.raises(ValueError, match="do not split evenly"):
        wm.pp_layer_range(7, 2, 0)
    local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    global_name = wm.globalize_name(local, layer_offset=4, expert_offset=2)
    assert global_name == "decoder.layers.5.mlp.experts.local_experts.2.linear_fc1.weight"
    assert wm.localize_name(global_name, 4, 2) == local
    assert wm.globalize_name("decoder.layers.0.mlp.experts.linear_fc2.weight1", 3, 4) == \
        "decoder.layers.3.mlp.experts.linear_fc2.weight5"
    assert wm.expert_owner(5, 8, 4) == (2, 1)


def test_unknown_family_is_named():
    with pytest.raises(ValueError, match="gemma"):
        wm.ModelLayout.from_hf_config({"model_type": "gemma", "num_attention_heads": 1, "hidden_size": 2,
                                        "num_hidden_layers": 1, "vocab_size": 3})


def test_names_and_shapes_match_a_real_megatron_model(tmp_path):
    """The mapping's names are exactly the parameters of a Megatron-Core GPTModel built with the
    local spec, and HF weights load into it and export back bit-exactly (runs where megatron-core
    imports; construction needs no GPU; the forward does, see test_megatron_gpu.py)."""
    pytest.importorskip("megatron.core")
    from slime.backends.megatron_utils.model import build_model_for_layout_check, iter_hf_weights, load_hf_weights

    for model_type in ("qwen2", "qwen3_moe", "deepseek_v3", "glm4_moe"):
        config, hf_state = _tiny_checkpoint(tmp_path, model_type)
        layout = wm.ModelLayout.from_hf_config(config, make_vocab_size_divisible_by=64)
        model = build_model_for_layout_check(config, layout)
        expected = {n: tuple(t.shape) for n, t in wm.hf_to_megatron(hf_state, layout).items()}
        built = {n: tuple(p.shape) for n, p in model.named_parameters()}
        built.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("router.expert_bias")})
        assert built == expected, model_type
        # and the safetensors go into that model and come back out unchanged
        assert load_hf_weights(model, str(tmp_path / model_type), layout) == len(expected)
        exported = dict(iter_hf_weights(model, layout))
        assert set(exported) == set(hf_state)
        for name, tensor in hf_state.items():
            assert torch.equal(exported[name], tensor), name


def test_fused_expert_layout_matches_transformers(tmp_path):
    """What the embedded engine loads: transformers 5 keeps a layer's experts as 3-D tensors."""
    from transformers import AutoModelForCausalLM

    config, hf_state = _tiny_checkpoint(tmp_path, "qwen3_moe")
    layout = wm.ModelLayout.from_hf_config(config)
    model_state = AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen3_moe"), dtype=torch.float32).state_dict()
    exported = wm.megatron_to_hf(wm.hf_to_megatron(hf_state, layout), layout)
    fused = dict(wm.fuse_experts_for_transformers(exported.items(), layout))
    assert set(fused) == set(model_state)
    for name, tensor in fused.items():
        assert torch.equal(tensor, model_state[name]), name
    partial = [(n, t) for n, t in exported.items() if ".experts.3." not in n]
    with pytest.raises(ValueError, match="expert tensors missing"):
        list(wm.fuse_experts_for_transformers(partial, layout))


def test_mla_layout_names_hf_tensors_one_to_one(tmp_path):
    """DeepSeek-V3: the MLA projections and latent norms, the router's expert bias and the shared
    experts, dense first layer; column-parallel MLA projections split in contiguous row blocks."""
    config, hf_state = _tiny_checkpoint(tmp_path, "deepseek_v3")
    layout = wm.ModelLayout.from_hf_config(config)
    assert layout.mla and layout.q_lora_rank == 24 and layout.expert_bias and layout.moe_layers == (False, True, True)
    megatron = wm.hf_to_megatron(hf_state, layout)
    p = "decoder.layers.1."
    assert torch.equal(megatron[p + "self_attention.linear_kv_up_proj.weight"], hf_state["model.layers.1.self_attn.kv_b_proj.weight"])
    assert torch.equal(megatron[p + "self_attention.kv_layernorm.weight"], hf_state["model.layers.1.self_attn.kv_a_layernorm.weight"])
    assert torch.equal(megatron[p + "mlp.router.expert_bias"], hf_state["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert megatron[p + "mlp.shared_experts.linear_fc1.weight"].shape == (32, 32)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in megatron and "decoder.layers.0.mlp.router.weight" not in megatron
    te = wm.ModelLayout.from_hf_config(config, te_fused_norms=True)
    assert p + "self_attention.linear_q_up_proj.layer_norm_weight" in wm.megatron_param_names(te)
    assert p + "input_layernorm.weight" in wm.megatron_param_names(te)  # TE's MLA keeps the input norm apart
    for name in ("linear_q_up_proj.weight", "linear_kv_down_proj.weight"):
        full = megatron[p + "self_attention." + name]
        assert wm.tp_kind(p + "self_attention." + name) == "column"
        assert torch.equal(wm.tp_merge(p + name, wm.tp_split(p + "self_attention." + name, full, 2)), full)


@pytest.mark.parametrize("model_type, missing", [("qwen3_5", "gated-DeltaNet"), ("qwen3_next", "gated-DeltaNet")])
def test_families_without_a_megatron_mapping_say_what_is_missing(model_type, missing):
    """A checkpoint given without a preset: the layout refuses it at start, naming what Megatron lacks and FSDP."""
    with pytest.raises(ValueError, match=f"{model_type!r} has no Megatron mapping .*{missing}.*--train-backend fsdp"):
        wm.ModelLayout.from_hf_config({"model_type": model_type, "num_hidden_layers": 2, "hidden_size": 8})

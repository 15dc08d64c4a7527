"""scripts/models presets <-> HF configs: the shape check names every mismatching field (CPU)."""

import shlex
import subprocess
from pathlib import Path

import pytest

from slime.backends.megatron_utils.model_config import (fill_model_args, hf_validate_args, model_args_from_hf_config,
                                                        parameter_count)
from slime.arguments import get_parser

PRESETS = Path(__file__).resolve().parents[3] / "scripts" / "models"

# The published config.json fields of each preset's model (the ones the check reads).
QWEN = dict(rms_norm_eps=1e-6, hidden_act="silu")
PUBLISHED = {
    "qwen2.5-0.5B": dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         tie_word_embeddings=True, **QWEN),
    "qwen2.5-1.5B": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         tie_word_embeddings=True, **QWEN),
    "qwen2.5-7B": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       tie_word_embeddings=False, **QWEN),
    "qwen3-0.6B": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, head_dim=128,
                       num_attention_heads=16, num_key_value_heads=8, vocab_size=151936, rope_theta=1000000,
                       tie_word_embeddings=True, **QWEN),
    "qwen3-1.7B": dict(model_type="qwen3", num_hidden_layers=28, hidden_size=2048, intermediate_size=6144, head_dim=128,
                       num_attention_heads=16, num_key_value_heads=8, vocab_size=151936, rope_theta=1000000,
                       tie_word_embeddings=True, **QWEN),
    "qwen3-4B": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, head_dim=128,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=151936, rope_theta=1000000,
                     tie_word_embeddings=True, **QWEN),
    "qwen3-8B": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, head_dim=128,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=151936, rope_theta=1000000,
                     tie_word_embeddings=False, **QWEN),
    "qwen3-30B-A3B": dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                          head_dim=128, num_attention_heads=32, num_key_value_heads=4, vocab_size=151936,
                          rope_theta=1000000.0, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          **QWEN),
    "llama3.1-8B": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "deepseek-v3": dict(model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, vocab_size=129280,
                        rope_theta=10000, tie_word_embeddings=False,
                        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 4096, "type": "yarn"}, **QWEN),
    "glm4.5-355B-A32B": dict(model_type="glm4_moe", num_hidden_layers=92, hidden_size=5120, intermediate_size=12288,
                             moe_intermediate_size=1536, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                             n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                             routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True,
                             attention_bias=True, partial_rotary_factor=0.5, rope_theta=1000000, rms_norm_eps=1e-5,
                             vocab_size=151552, tie_word_embeddings=False, hidden_act="silu"),
    "glm4.5-air": dict(model_type="glm4_moe", num_hidden_layers=46, hidden_size=4096, intermediate_size=10944,
                       moe_intermediate_size=1408, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                       n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                       routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=False,
                       attention_bias=True, partial_rotary_factor=0.5, rope_theta=1000000, rms_norm_eps=1e-5,
                       vocab_size=151552, tie_word_embeddings=False, hidden_act="silu"),
    "moonlight-16B-A3B": dict(model_type="deepseek_v3", num_hidden_layers=27, hidden_size=2048, intermediate_size=11264,
                              moe_intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16,
                              n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=2.446, kv_lora_rank=512,
                              q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1,
                              topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=True,
                              vocab_size=163840, rope_theta=50000.0, rope_scaling=None, tie_word_embeddings=False,
                              rms_norm_eps=1e-5, hidden_act="silu"),
    "kimi-k2": dict(model_type="kimi_k2", num_hidden_layers=61, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
                    n_routed_experts=384, routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
                    num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True, vocab_size=163840,
                    rope_theta=50000.0, tie_word_embeddings=False,
                    rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
                    **QWEN),
}

# Qwen3.5: multimodal checkpoints; the language model's fields sit in text_config (transformers' Qwen3_5TextConfig)
QWEN35_TEXT = dict(head_dim=256, rms_norm_eps=1e-6, hidden_act="silu", vocab_size=248320, attention_bias=False,
                   full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_num_key_heads=16,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def _qwen35(model_type, tie, **text):
    layers = text["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return dict(model_type=model_type, tie_word_embeddings=tie,
                text_config=dict(model_type=model_type + "_text", layer_types=layer_types, tie_word_embeddings=tie,
                                 **QWEN35_TEXT, **text))


PUBLISHED.update({
    "qwen3.5-0.8B": _qwen35("qwen3_5", True, num_hidden_layers=24, hidden_size=1024, intermediate_size=3584,
                            num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16),
    "qwen3.5-4B": _qwen35("qwen3_5", True, num_hidden_layers=32, hidden_size=2560, intermediate_size=9216,
                          num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32),
    "qwen3.5-9B": _qwen35("qwen3_5", False, num_hidden_layers=32, hidden_size=4096, intermediate_size=12288,
                          num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32),
    "qwen3.5-27B": _qwen35("qwen3_5", False, num_hidden_layers=64, hidden_size=5120, intermediate_size=17408,
                           num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48),
    "qwen3.5-35B-A3B": _qwen35("qwen3_5_moe", False, num_hidden_layers=40, hidden_size=2048, num_attention_heads=16,
                               num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512),
    "qwen3-next-80B-A3B": dict(model_type="qwen3_next", num_hidden_layers=48, hidden_size=2048, intermediate_size=5120,
                               num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=151936,
                               rope_theta=10000000, partial_rotary_factor=0.25, tie_word_embeddings=False,
                               full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                               num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                               mlp_only_layers=[], attention_bias=False, **QWEN),
    "glm4-9B": dict(model_type="glm4", num_hidden_layers=40, hidden_size=4096, intermediate_size=13696,
                    num_attention_heads=32, num_key_value_heads=2, head_dim=128, vocab_size=151552, rope_theta=10000.0,
                    partial_rotary_factor=0.5, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
                    hidden_act="silu"),
    "glm4-32B": dict(model_type="glm4", num_hidden_layers=61, hidden_size=6144, intermediate_size=23040,
                     num_attention_heads=48, num_key_value_heads=2, head_dim=128, vocab_size=151552, rope_theta=10000.0,
                     partial_rotary_factor=0.5, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
                     hidden_act="silu"),
})

# Total parameters each model's card publishes (billions; MTP modules excluded where the card counts them apart)
PUBLISHED_TOTAL_B = {
    "qwen2.5-0.5B": 0.49, "qwen2.5-1.5B": 1.54, "qwen2.5-7B": 7.61, "qwen3-0.6B": 0.6, "qwen3-1.7B": 1.7,
    "qwen3-4B": 4.0, "qwen3-8B": 8.2, "qwen3-30B-A3B": 30.5, "llama3.1-8B": 8.03, "deepseek-v3": 671,
    "glm4.5-355B-A32B": 355, "glm4.5-air": 106, "moonlight-16B-A3B": 16, "kimi-k2": 1000,
    "qwen3-next-80B-A3B": 80, "glm4-9B": 9.4, "glm4-32B": 32.6,
}
# Qwen3.5's published sizes include its vision tower: its presets' language models are counted against the
# model transformers builds from the same config instead (test_hybrid_parameter_count_is_transformers')
TEXT_OF_MULTIMODAL = ("qwen3.5-0.8B", "qwen3.5-4B", "qwen3.5-9B", "qwen3.5-27B", "qwen3.5-35B-A3B")

BASE = ["--rollout-batch-size", "1", "--num-rollout", "1"]


def preset_args(name: str) -> list[str]:
    """MODEL_ARGS of a preset, as bash expands it."""
    out = subprocess.run(["bash", "-c", f'source {shlex.quote(str(PRESETS / (name + ".sh")))} && printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def parse(argv: list[str]):
    parser, _ = get_parser(parse_sglang=False)
    return parser.parse_args(BASE + argv)


def test_every_preset_is_checked():
    assert {p.stem for p in PRESETS.glob("*.sh")} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_config(name):
    args = parse(preset_args(name))
    args.hf_checkpoint = f"/models/{name}"
    hf_validate_args(args, PUBLISHED[name])
    # and every shape flag a preset sets is what the config says
    expected = model_args_from_hf_config(PUBLISHED[name])
    for dest in ("num_layers", "hidden_size", "num_query_groups", "kv_channels", "vocab_size", "qk_layernorm",
                 "add_qkv_bias", "untie_embeddings_and_output_weights", "use_rope_scaling", "multi_latent_attention",
                 "moe_layer_freq", "moe_router_score_function", "moe_router_enable_expert_bias", "rotary_percent",
                 "rotary_interleaved", "use_gated_attention", "apply_layernorm_1p", "experimental_attention_variant",
                 "linear_attention_freq", "linear_num_value_heads", "post_self_attn_layernorm", "post_mlp_layernorm",
                 "moe_shared_expert_gate"):
        assert getattr(args, dest) == expected[dest], dest


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL_B))
def test_preset_parameter_count_is_the_published_total(name):
    """The shape a preset describes has the model card's parameter count (within 3%): catches a
    wrong layer count, expert count or expert width that the config check alone could share."""
    count = parameter_count(parse(preset_args(name))) / 1e9
    assert count == pytest.approx(PUBLISHED_TOTAL_B[name], rel=0.03), f"{name}: {count:.2f}B"


@pytest.mark.parametrize("name", ["qwen3.5-0.8B", "qwen3.5-35B-A3B", "qwen3-next-80B-A3B", "glm4-9B"])
def test_hybrid_parameter_count_is_transformers(name):
    """The count of gated-DeltaNet, gated-attention and sandwich-norm layers equals the parameters of the model
    transformers builds from the published config (on the meta device: no memory)."""
    import torch
    import transformers

    from slime.backends.megatron_utils.model_config import text_config

    config = text_config(PUBLISHED[name])
    kind = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(config["model_type"], config["model_type"])
    fields = {k: v for k, v in config.items() if k not in ("model_type", "text_config")}
    hf_config = transformers.AutoConfig.for_model(kind, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert parameter_count(parse(preset_args(name))) == sum(p.numel() for p in model.parameters())


def test_every_preset_is_counted():
    assert set(PUBLISHED_TOTAL_B) | set(TEXT_OF_MULTIMODAL) == set(PUBLISHED)


def test_hybrid_and_sandwich_norm_mismatches_are_named():
    """A Qwen3.5 preset without its linear-attention layers, or a GLM-4 one without the output norms, is named."""
    argv = preset_args("qwen3.5-9B")
    args = parse([a for a in argv if a not in ("--use-gated-attention",)] + ["--linear-attention-freq", "2"])
    args.hf_checkpoint = "/models/qwen3.5-9B"
    with pytest.raises(AssertionError) as info:
        hf_validate_args(args, PUBLISHED["qwen3.5-9B"])
    assert "--use-gated-attention False but config.json model_type qwen3_5" in str(info.value)
    assert "--linear-attention-freq" in str(info.value)
    args = parse(preset_args("glm4.5-air"))
    args.hf_checkpoint = "/models/glm4-9B"
    with pytest.raises(AssertionError, match="--post-self-attn-layernorm False but config.json model_type glm4.*"
                                             "--rotary-interleaved False"):
        hf_validate_args(args, PUBLISHED["glm4-9B"])


def test_parameter_count_sees_a_wrong_expert_count():
    count = parameter_count(parse(preset_args("kimi-k2") + ["--num-experts", "256"])) / 1e9
    assert count < 0.7 * PUBLISHED_TOTAL_B["kimi-k2"]


def test_kimi_yarn_betas_are_checked():
    """Kimi-K2's YaRN uses beta_fast 1 (DeepSeek-V3's 32 is Megatron's default): a preset without it is named."""
    argv = preset_args("kimi-k2")
    at = argv.index("--yarn-beta-fast")
    args = parse(argv[:at] + argv[at + 2:])
    args.hf_checkpoint = "/models/kimi-k2"
    with pytest.raises(AssertionError, match="--yarn-beta-fast 32.0 but config.json rope_scaling.beta_fast 1.0"):
        hf_validate_args(args, PUBLISHED["kimi-k2"])


def test_mismatches_are_named():
    args = parse(preset_args("qwen3-0.6B") + ["--rotary-base", "10000", "--num-query-groups", "4"])
    args.hf_checkpoint = "/models/qwen3-0.6B"
    with pytest.raises(AssertionError) as info:
        hf_validate_args(args, PUBLISHED["qwen3-0.6B"])
    message = str(info.value)
    assert message.startswith("hf_validate_args failed")
    assert "--rotary-base 10000.0 but config.json rope_theta 1000000" in message
    assert "--num-query-groups 4 but config.json num_key_value_heads 8" in message


def test_wrong_family_preset_fails():
    """A Qwen2.5 preset (no qk-layernorm, qkv bias, tied) against a Qwen3 config."""
    args = parse(preset_args("qwen2.5-1.5B"))
    args.hf_checkpoint = "/models/qwen3-1.7B"
    with pytest.raises(AssertionError, match="--qk-layernorm False but config.json model_type qwen3"):
        hf_validate_args(args, PUBLISHED["qwen3-1.7B"])


def test_rope_theta_inside_rope_parameters_and_moe_fields():
    config = dict(PUBLISHED["qwen3-30B-A3B"])
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    args = parse(preset_args("qwen3-30B-A3B"))
    args.hf_checkpoint = "/models/qwen3-30B-A3B"
    hf_validate_args(args, config)
    args.moe_router_topk = 2
    with pytest.raises(AssertionError, match="--moe-router-topk 2 but config.json num_experts_per_tok 8"):
        hf_validate_args(args, config)


def test_without_preset_the_shape_comes_from_the_config():
    args = parse([])
    filled = fill_model_args(args, PUBLISHED["qwen2.5-7B"])
    assert "--num-layers" in filled and args.num_layers == 28 and args.add_qkv_bias and args.untie_embeddings_and_output_weights
    args.hf_checkpoint = "/models/qwen2.5-7B"
    hf_validate_args(args, PUBLISHED["qwen2.5-7B"])
    # a preset given: nothing is overwritten
    args = parse(preset_args("qwen3-4B"))
    assert fill_model_args(args, PUBLISHED["qwen2.5-7B"]) == []


def test_moe_layer_freq_flag():
    assert parse(["--moe-layer-freq", "([0]*1+[1]*3)"]).moe_layer_freq == [0, 1, 1, 1]
    assert parse(["--moe-layer-freq", "2"]).moe_layer_freq == 2
    with pytest.raises(SystemExit):
        parse(["--moe-layer-freq", "__import__('os')"])


def test_parse_args_checks_a_preset_against_the_checkpoint(tmp_path, monkeypatch):
    """With --train-backend megatron, a preset that disagrees with --hf-checkpoint fails at parse time."""
    import importlib.util
    import json

    from slime.arguments import parse_args

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # the parse-time check needs no Megatron install
                        lambda name, *a: object() if name == "megatron" else real_find_spec(name, *a))
    hf = tmp_path / "qwen3-0.6B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(PUBLISHED["qwen3-0.6B"]))
    base = ["--train-backend", "megatron", "--rollout-backend", "embedded", "--debug-train-only", "--num-rollout", "1",
            "--rollout-batch-size", "1", "--hf-checkpoint", str(hf)]
    parse_args(base + preset_args("qwen3-0.6B"))
    with pytest.raises(AssertionError, match="--hidden-size 2048 but config.json hidden_size 1024"):
        parse_args(base + preset_args("qwen3-1.7B"))
    parse_args(base)  # no preset: the shape is taken from the config later


def test_mla_and_sigmoid_router_mismatches_are_named():
    """DeepSeek-V3's MLA ranks, YaRN factor, group-limited routing and dense layers are compared too."""
    args = parse(preset_args("deepseek-v3") + ["--kv-lora-rank", "256", "--rotary-scaling-factor", "4",
                                              "--moe-router-group-topk", "2", "--moe-layer-freq", "([0]*1+[1]*60)"])
    args.hf_checkpoint = "/models/deepseek-v3"
    with pytest.raises(AssertionError) as info:
        hf_validate_args(args, PUBLISHED["deepseek-v3"])
    message = str(info.value)
    for part in ("--kv-lora-rank 256 but config.json kv_lora_rank 512", "--rotary-scaling-factor 4.0 but config.json rope_scaling.factor 40",
                 "--moe-router-group-topk 2 but config.json topk_group 4", "--moe-layer-freq [0, 1,"):
        assert part in message, (part, message)
    # a GLM-4.5 preset against GLM-4.5-Air: qk-norm, layer count and experts differ
    args = parse(preset_args("glm4.5-355B-A32B"))
    args.hf_checkpoint = "/models/glm4.5-air"
    with pytest.raises(AssertionError, match="--num-layers 92 but config.json num_hidden_layers 46.*--qk-layernorm True"):
        hf_validate_args(args, PUBLISHED["glm4.5-air"])


def test_moe_families_fill_from_config(tiny_deepseek_v3_dir, tiny_glm4_moe_dir):
    """Without a preset the MLA / sigmoid-router flags come from the checkpoint (the tiny ones here)."""
    from slime.backends.megatron_utils.model_config import load_hf_config

    args = parse([])
    fill_model_args(args, load_hf_config(tiny_deepseek_v3_dir))
    assert args.multi_latent_attention and (args.q_lora_rank, args.kv_lora_rank) == (64, 32)
    assert (args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim, args.rope_type) == (16, 8, 16, "yarn")
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert args.moe_layer_freq == [0, 1, 1, 1] and args.moe_shared_expert_intermediate_size == 96
    args = parse([])
    fill_model_args(args, load_hf_config(tiny_glm4_moe_dir))
    assert not args.multi_latent_attention and args.rotary_percent == 0.5 and args.add_qkv_bias and args.qk_layernorm
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias

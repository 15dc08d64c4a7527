"""The FLOPs estimate behind every ``perf/*_tflops`` figure, on models small enough to count by hand."""

import pytest

from slime.backends.training.flops import FlopShape, training_flops

DENSE = {"hidden_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 2, "num_key_value_heads": 1,
         "intermediate_size": 3, "vocab_size": 10}


def test_dense_model_counted_by_hand():
    shape = FlopShape.from_hf_config(DENSE)
    # per layer: q 4x4, k 4x2, v 4x2, o 4x4 = 16 + 8 + 8 + 16 = 48; gate/up/down 3 x 4x3 = 36 -> 84; two layers
    assert shape.body == 168 and shape.head == 40 and shape.layers == 2 and shape.attention_width == 4
    # two samples of 3 and 5 tokens, 1 + 3 response tokens through the head:
    # 6·168·8 = 8064 (every position) + 6·40·4 = 960 (head) + 6·2·4·(3² + 5²) = 1632 (causal attention)
    assert training_flops(shape, [3, 5], 4) == 8064 + 960 + 1632
    critic = FlopShape.from_hf_config(DENSE, role="critic")
    assert critic.head == 4 and training_flops(critic, [3, 5], 4) == 8064 + 6 * 4 * 4 + 1632


def test_moe_counts_the_experts_a_token_visits():
    config = {**DENSE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 1, "mlp_only_layers": [0]}
    shape = FlopShape.from_hf_config(config)
    # layer 0 dense (48 + 36); layer 1: attention 48 + two experts 3·4·(2·1) = 24 + router 4·8 = 32 -> 104
    assert shape.body == 84 + 104


def test_body_equals_the_parameters_a_token_meets_in_a_real_model(tiny_model_dir):
    """On the tiny Qwen3: the formula's per-token body is every decoder matrix (norm vectors aside)."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        config = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    matrices = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name and "norm" not in name)
    shape = FlopShape.from_hf_config(config)
    assert shape.body == pytest.approx(matrices, rel=0, abs=0)
    assert shape.head == model.get_output_embeddings().weight.numel()

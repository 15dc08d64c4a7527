"""Build a tiny Hugging Face checkpoint (Qwen3, DeepSeek-V3 or GLM-4.5 architecture) offline, for tests and the CPU quick start.

No model can be downloaded on the machines slime is tested on, so tests and the quick start make
their own: a byte-level BPE tokenizer trained with the ``tokenizers`` library on a small synthetic
corpus, a Qwen-style chat template (system/user/assistant/tool turns, tool schemas, ``<tool_call>``
blocks), and a randomly initialised ``Qwen3ForCausalLM`` (or, with ``--arch``, a
``DeepseekV3ForCausalLM`` / ``Glm4MoeForCausalLM``: MoE with multi-latent or grouped-query attention). Everything is deterministic from the seed.

    python -m slime.utils.tiny_model --out /tmp/tiny --size tiny --seed 0

The directory loads with ``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained``
and ``tokenizer.apply_chat_template`` with no network.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

# Special tokens, in id order right after the byte-level alphabet's merges (Qwen spelling).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# A Qwen2.5/Qwen3-style template: optional system prompt, tool schemas in the system turn,
# assistant tool calls as <tool_call>{json}</tool_call>, tool results wrapped in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


SIZES = {
    # ~0.9M parameters: fast enough to train and sample on two CPU cores in seconds.
    "tiny": TinyModelSize(128, 4, 4, 2, 32, 384, 1024),
    # ~5M parameters: still CPU friendly, closer to a "real" model's proportions.
    "small": TinyModelSize(256, 6, 8, 4, 32, 768, 2048),
}


def _corpus(seed: int) -> list[str]:
    """Synthetic text the tokenizer is trained on: arithmetic, chat markup, tool-call JSON, prose."""
    rng = random.Random(seed)
    words = (
        "the a an of to in is are was were be for with on as by at from that this it you we they "
        "what which who how many much sum add plus minus times answer question number result value "
        "please compute tell me call function tool weather city temperature name arguments search "
        "query user assistant system hello world true false null yes no ok done think step reverse "
        "sort list string word letter digit count copy repeat first last next each"
    ).split()
    lines = []
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{a}+{b}={a + b}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
    for _ in range(400):
        city = rng.choice(["Paris", "Tokyo", "Berlin", "Lima", "Oslo"])
        lines.append(json.dumps({"name": "get_weather", "arguments": {"city": city}}))
        lines.append(f"<|im_start|>user\nWhat is the weather in {city}?<|im_end|>\n<|im_start|>assistant\n")
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0):
    """Train a byte-level BPE tokenizer (digits split one per token, as Qwen does) and wrap it as a
    transformers ``PreTrainedTokenizerFast`` with the chat template and special tokens set."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


#: architectures the builder makes: the dense Qwen3 default, DeepSeek-V3, GLM-4.5 (MoE), Qwen3-MoE, the hybrid
#: Qwen3.5 (dense and MoE language models) and Qwen3-Next, and GLM-4 dense
ARCHITECTURES = ("qwen3", "deepseek_v3", "glm4_moe", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "glm4")


#: the hybrid families' linear-attention layers: 2 key heads shared by 4 value heads (the grouped-value layout of
#: the released models), a 4-wide causal convolution
LINEAR_ATTENTION = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4)


def _config(arch: str, shape: TinyModelSize, vocab_size: int, max_position_embeddings: int, special: dict):
    """The HF config of ``arch`` at ``shape``. The MoE families keep their distinguishing features:
    DeepSeek-V3 has MLA (q and kv LoRA, decoupled interleaved rotary, YaRN), sigmoid routing with an
    expert bias and group-limited top-k, a shared expert and a dense first layer; GLM-4.5 has GQA with
    partial rotary, qkv bias and qk-norm, and the same sigmoid router over one group."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                  num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
                  max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, torch_dtype="float32", **special)
    if arch == "qwen3":
        return transformers.Qwen3Config(num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
                                        rope_theta=10000.0, tie_word_embeddings=True, **common)
    if arch == "qwen3_moe":  # softmax top-2 of 8 experts, no shared expert, every layer MoE
        return transformers.Qwen3MoeConfig(num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
                                           rope_theta=10000.0, tie_word_embeddings=True, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=shape.intermediate_size // 4,
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    moe = dict(moe_intermediate_size=shape.intermediate_size // 4, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
               tie_word_embeddings=False)
    if arch == "deepseek_v3":
        head = shape.head_dim
        return transformers.DeepseekV3Config(
            num_key_value_heads=shape.num_attention_heads, q_lora_rank=shape.hidden_size // 2,
            kv_lora_rank=shape.hidden_size // 4, qk_nope_head_dim=head // 2, qk_rope_head_dim=head // 4,
            v_head_dim=head // 2, n_group=2, topk_group=1, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            **moe, **common)
    if arch == "glm4_moe":
        return transformers.Glm4MoeConfig(
            num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim, attention_bias=True,
            use_qk_norm=True, n_group=1, topk_group=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **moe, **common)
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        # gated-DeltaNet linear attention in layers 0-2 (of 4), gated softmax attention in layer 3
        hybrid = dict(num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim, tie_word_embeddings=True,
                      **LINEAR_ATTENTION,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=shape.intermediate_size // 4,
                   shared_expert_intermediate_size=shape.intermediate_size // 4)
        if arch == "qwen3_5":
            return transformers.Qwen3_5TextConfig(**hybrid, **common)
        if arch == "qwen3_5_moe":
            return transformers.Qwen3_5MoeTextConfig(**hybrid, **moe, **common)
        return transformers.Qwen3NextConfig(**hybrid, **moe, norm_topk_prob=True, decoder_sparse_step=1,
                                            mlp_only_layers=[], **common)
    if arch == "glm4":  # post-attention and post-MLP norms, interleaved partial rotary, qkv bias
        return transformers.Glm4Config(num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
                                       attention_bias=True, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5}, **common)
    raise ValueError(f"unknown tiny model architecture {arch!r}; choose one of {list(ARCHITECTURES)}")


def build_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, max_position_embeddings: int = 2048,
                     arch: str = "qwen3"):
    """Write an HF checkpoint directory of ``arch`` (Qwen3 by default; ``deepseek_v3`` or
    ``glm4_moe`` for the MoE families) to ``out_dir`` and return its path.

    The checkpoint holds ``config.json``, ``generation_config.json`` (stop ids: ``<|im_end|>`` and
    ``<|endoftext|>``), ``model.safetensors`` and the tokenizer files.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {sorted(SIZES)}")
    shape = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(shape.vocab_size, seed)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = _config(arch, shape, len(tokenizer), max_position_embeddings,
                     dict(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if arch in ("deepseek_v3", "glm4_moe"):
        with torch.no_grad():  # a random expert bias (zero at init) so that it decides some top-k choices
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.05)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def count_parameters(model_dir: str | Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for key in f.keys():
            total += _prod(f.get_slice(key).get_shape())
    return total


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory for the HF checkpoint")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--arch", default="qwen3", choices=ARCHITECTURES)
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out, args.size, args.seed, args.max_position_embeddings, args.arch)
    print(json.dumps({"model_dir": str(out), "size": args.size, "arch": args.arch, "parameters": count_parameters(out)}))


if __name__ == "__main__":
    main()

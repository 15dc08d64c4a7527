"""Build a tiny Qwen2.5-VL / Qwen3-VL / Qwen3.5 checkpoint offline (model, tokenizer, image processor), for tests and examples.

The tokenizer is :mod:`slime.utils.tiny_model`'s byte-level BPE plus Qwen's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``); the chat template
renders an image part of a message as ``<|vision_start|><|image_pad|><|vision_end|>`` as Qwen's does.
The image processor is Qwen2-VL's with 14-pixel patches merged 2x2 and small pixel bounds, so a
56x56 image is 4 language-model tokens. Qwen3.5's language model is the hybrid one (gated-DeltaNet
linear attention beside gated softmax attention, as its ``layer_types`` say). ``qwen3_vl_moe`` and
``qwen3_5_moe`` are the MoE variants (top-2 of 8 experts in every layer).

    python -m slime.utils.tiny_vlm --out /tmp/tiny_vlm --arch qwen2_5_vl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slime.utils.tiny_model import CHAT_TEMPLATE, ENDOFTEXT, IM_END, LINEAR_ATTENTION, SIZES, build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")

#: how a message's content is rendered: a string as is, a list part by part (Qwen2.5-VL's template)
_CONTENT = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' or 'image' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
VLM_CHAT_TEMPLATE = _CONTENT + CHAT_TEMPLATE.replace("message.content", "render(message.content)").replace(
    "messages[0].content", "render(messages[0].content)").replace(
    "{%- if render(message.content) %}", "{%- if message.content %}")

#: Qwen2-VL image processor settings: 14-pixel patches, 2x2 merge; 56x56 .. 112x112 pixels (4 .. 16 tokens)
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
#: CLIP's normalization (the tiny checkpoints'; Qwen3-VL's published processor uses 0.5 for every channel)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def build_vlm_tokenizer(vocab_size: int, seed: int = 0):
    tokenizer = build_tokenizer(vocab_size, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def _config(arch: str, vocab_size: int, special: dict, ids: dict):
    import transformers

    shape = SIZES["tiny"]
    text = dict(vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
                num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=2048, rms_norm_eps=1e-6,
                **special)
    # the rotary halves of a 32-wide head split over (time, height, width)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, out_hidden_size=shape.hidden_size)
    if arch == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
        vision.update(window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                             **ids)
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        text.update(head_dim=shape.head_dim, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": [4, 6, 6], "mrope_interleaved": True})
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        vision["out_hidden_size"] = shape.hidden_size
        if arch == "qwen3_vl":
            return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        # softmax top-2 of 8 experts in every layer, no shared expert (Qwen3-VL-30B-A3B's layout)
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=shape.intermediate_size // 4,
                    decoder_sparse_step=1, mlp_only_layers=[])
        return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        # the tiny hybrid language model of slime.utils.tiny_model (gated-DeltaNet linear attention in layers
        # 0-2, gated softmax attention in layer 3); interleaved M-RoPE over the rotary quarter of each head
        # (8 of 32 dimensions: 4 frequencies split 2 / 1 / 1 over time, height, width)
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        text.update(head_dim=shape.head_dim, layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters=rope, **LINEAR_ATTENTION)
        vision.update(num_position_embeddings=64)
        if arch == "qwen3_5":
            return transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        # softmax top-2 of 8 experts and a sigmoid-gated shared expert in every layer
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=shape.intermediate_size // 4,
                    shared_expert_intermediate_size=shape.intermediate_size // 4)
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    raise ValueError(f"unknown tiny VLM architecture {arch!r}; choose one of {list(ARCHITECTURES)}")


def image_processor_config(arch: str, patch_size: int = PATCH_SIZE, min_pixels: int = MIN_PIXELS,
                           max_pixels: int = MAX_PIXELS, mean=CLIP_MEAN, std=CLIP_STD) -> dict:
    """``preprocessor_config.json`` of a checkpoint of ``arch``: Qwen2-VL's image processor, by default with the
    tiny checkpoint's small bounds (a real-size checkpoint passes its own patch size, pixel bounds and norms)."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": (
        "Qwen2_5_VLProcessor" if arch == "qwen2_5_vl" else "Qwen3VLProcessor"),  # Qwen3.5's is Qwen3-VL's
        "patch_size": patch_size, "merge_size": MERGE_SIZE, "temporal_patch_size": 2,
        "min_pixels": min_pixels, "max_pixels": max_pixels, "size": {"shortest_edge": min_pixels,
                                                                     "longest_edge": max_pixels},
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": list(mean), "image_std": list(std), "do_convert_rgb": True}


def vlm_tokenizer(seed: int = 0):
    """The tiny VLM tokenizer, the token ids its config needs (``bos``/``eos``/``pad``) and its vision token
    ids (``image_token_id``, ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id``)."""
    tokenizer = build_vlm_tokenizer(SIZES["tiny"].vocab_size, seed)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    special = dict(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    ids = {"image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
           "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
           "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
           "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>")}
    return tokenizer, special, ids


def save_vlm(model, tokenizer, out_dir: str | Path, processor_config: dict) -> Path:
    """Write ``model`` (sampling generation config), ``tokenizer``, its chat template and ``processor_config``
    as a checkpoint directory."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos_id, pad_id = model.config.get_text_config().eos_token_id, model.config.get_text_config().pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id],
                                               pad_token_id=pad_id, do_sample=True, temperature=1.0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(processor_config, indent=2))
    (out / "chat_template.jinja").write_text(VLM_CHAT_TEMPLATE)
    return out


def build_tiny_vlm(out_dir: str | Path, arch: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """Write a tiny ``arch`` checkpoint directory (config, weights, tokenizer, preprocessor config)."""
    import torch
    from transformers import AutoModelForImageTextToText

    tokenizer, special, ids = vlm_tokenizer(seed)
    config = _config(arch, len(tokenizer), special, ids)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    return save_vlm(model, tokenizer, out_dir, image_processor_config(arch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", default="qwen2_5_vl", choices=ARCHITECTURES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_vlm(args.out, args.arch, args.seed))


if __name__ == "__main__":
    main()

"""bench/engine_decode.py with pictures: each request's image tokens are the processor's count, its text is the
text-only model's prompt, and its pictures are deterministic and distinct."""

from __future__ import annotations

import pytest

from bench.engine_decode import image_workload, make_workload, text_vocab
from slime.utils.multimodal import fallback_processor, image_inputs, load_image


def test_image_requests_expand_each_picture_to_the_processors_count_in_front_of_the_text_models_prompt(
        tiny_qwen3_vl_dir, tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    # the vision-language checkpoint draws the same text prompts as the text-only one, none of them a vision token
    assert text_vocab(tiny_qwen3_vl_dir) == text_vocab(tiny_model_dir)
    prompts, _ = make_workload(3, text_vocab(tiny_qwen3_vl_dir), seed=0, prompt_len=16, max_new_tokens=8)
    assert prompts == make_workload(3, text_vocab(tiny_model_dir), seed=0, prompt_len=16, max_new_tokens=8)[0]

    config = AutoConfig.from_pretrained(tiny_qwen3_vl_dir)
    expanded, image_data, counts = image_workload(tiny_qwen3_vl_dir, prompts, images=2, size=448, seed=0)
    processor = fallback_processor(tiny_qwen3_vl_dir, AutoTokenizer.from_pretrained(tiny_qwen3_vl_dir))
    pictures = [load_image(url) for url in image_data[0]]
    assert [picture.size for picture in pictures] == [(448, 448)] * 2
    assert counts == image_inputs(processor, pictures)[1] == [16, 16]  # the tiny processor's 112x112 bound: 8x8 patches, 2x2 merged
    block = [config.vision_start_token_id] + [config.image_token_id] * 16 + [config.vision_end_token_id]
    assert all(ids == block * 2 + prompt for ids, prompt in zip(expanded, prompts))
    # the same pictures on every run, a different one for every request and image
    assert image_workload(tiny_qwen3_vl_dir, prompts, images=2, size=448, seed=0)[1] == image_data
    assert len({url for row in image_data for url in row}) == 6


def test_pictures_for_a_text_only_checkpoint_are_refused_with_the_models_to_use(tiny_model_dir):
    with pytest.raises(SystemExit, match="not a vision-language checkpoint.*qwen3-vl-2b or tiny-vl"):
        image_workload(tiny_model_dir, [[11, 12]], images=1, size=448, seed=0)

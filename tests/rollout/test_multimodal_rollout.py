"""The default generator with images: the prompt's placeholders expanded, the images sent as
``image_data``, the trainer's inputs on the sample, and a bad image failing only its own sample."""

import json

from PIL import Image

from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import GenerateState, generate
from slime.utils.async_utils import run
from slime.utils.multimodal import load_image
from slime.utils.types import Sample
from tests.rollout.stand_in_engine import Reply
from tests.rollout.test_sglang_rollout import engine, make_args  # noqa: F401  (the fixture)


def _rows(tmp_path):
    Image.new("RGB", (56, 56), (0, 0, 255)).save(tmp_path / "blue.png")
    Image.new("RGB", (112, 56), (0, 255, 0)).save(tmp_path / "green.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    rows = [
        {"input": "<image>How many shapes?", "images": [str(tmp_path / "blue.png")], "label": "1"},
        {"input": "Compare <image> with <image>", "images": [str(tmp_path / "blue.png"), str(tmp_path / "green.png")],
         "label": "2"},
        {"input": "<image>How many?", "images": [str(tmp_path / "missing.png")], "label": "0"},
        {"input": "<image>How many?", "images": ["https://example.com/shapes.png"], "label": "0"},
        {"input": "<image>How many?", "images": [str(tmp_path / "broken.png")], "label": "0"},
    ]
    path = tmp_path / "vlm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_images_reach_the_engine_and_bad_ones_fail_their_sample(tiny_vlm_dir, tmp_path, engine):  # noqa: F811
    args = make_args(tiny_vlm_dir, _rows(tmp_path), engine, "--multimodal-keys", '{"image": "images"}',
                     "--apply-chat-template", "--rollout-batch-size", "5", "--n-samples-per-prompt", "1")
    engine.holder["script"] = lambda payload: Reply(tokens=[11, 12], logprobs=[-0.5, -0.25])
    samples = [group[0] for group in RolloutDataSourceWithBuffer(args).get_samples(5)]
    state = GenerateState(args)
    done = [run(generate(args, s, dict(state.sampling_params))) for s in samples]
    pad = state.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    assert [s.status for s in done] == [Sample.Status.COMPLETED] * 2 + [Sample.Status.FAILED] * 3
    assert "image file not found" in done[2].metadata["generate_error"]
    assert "remote image URLs are not fetched" in done[3].metadata["generate_error"]
    assert "not a readable image" in done[4].metadata["generate_error"]
    assert len(engine.requests) == 2  # the failed samples sent nothing

    one, two = done[0], done[1]
    assert one.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert two.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert one.tokens.count(pad) == 4 and two.tokens.count(pad) == 4 + 8
    assert one.tokens[-2:] == [11, 12] and one.response_length == 2 and one.rollout_log_probs == [-0.5, -0.25]
    first, second = engine.requests
    # SGLang's multimodal request: the prompt text with one placeholder per image, which the engine expands
    assert "input_ids" not in first and len(first["image_data"]) == 1
    assert state.tokenizer.encode(first["text"], add_special_tokens=False) == [
        t for i, t in enumerate(one.tokens[:-2]) if t != pad or one.tokens[i - 1] != pad]
    assert len(second["image_data"]) == 2
    sent = load_image(second["image_data"][1])
    assert sent.size == (112, 56) and sent.getpixel((5, 5)) == (0, 255, 0)


def test_sft_rollout_expands_images_as_context(tiny_vlm_dir, tmp_path):
    from slime.rollout.sft_rollout import generate_rollout as sft_generate_rollout
    from slime.utils.multimodal import process_images
    from slime.utils.processing_utils import load_processor
    from tests.rollout.test_data_source import make_args as data_args

    Image.new("RGB", (84, 56), (200, 0, 0)).save(tmp_path / "red.png")
    conversation = [{"role": "user", "content": "<image>How many?"}, {"role": "assistant", "content": "3"}]
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": conversation, "images": [str(tmp_path / "red.png")]}) + "\n")
    args = data_args(tiny_vlm_dir, str(path), "--input-key", "messages", "--label-key", "", "--n-samples-per-prompt",
                     "1", "--rollout-batch-size", "1", "--multimodal-keys", '{"image": "images"}')
    sample = sft_generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)).samples[0][0]
    processor = load_processor(tiny_vlm_dir)
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}], tokenize=False,
        add_generation_prompt=True)
    prompt_ids, inputs = process_images(processor, prompt, [load_image(str(tmp_path / "red.png"))])
    assert sample.tokens[:len(prompt_ids)] == prompt_ids  # 6 image tokens in the prompt, none trained
    assert processor.tokenizer.decode(sample.tokens[len(prompt_ids):]).startswith("3<|im_end|>")
    assert sample.response_length == len(sample.tokens) - len(prompt_ids) and sample.loss_mask[0] == 1
    assert sample.multimodal_train_inputs["image_grid_thw"].tolist() == inputs["image_grid_thw"].tolist() == [[1, 4, 6]]

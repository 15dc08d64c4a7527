"""Images in prompts: every accepted form loads, every bad one is refused with its reason, and the
processor expands each placeholder to the image's token count."""

import base64
import io

import pytest
from PIL import Image

from slime.utils.multimodal import MAX_IMAGE_PIXELS, MediaError, encode_image, load_image, process_images
from slime.utils.processing_utils import load_processor


def _png(size=(60, 40), color=(255, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_accepted_form_loads_the_same_pixels(tmp_path):
    raw = _png()
    path = tmp_path / "red.png"
    path.write_bytes(raw)
    data_url = "data:image/png;base64," + base64.b64encode(raw).decode()
    forms = [str(path), f"file://{path}", data_url, base64.b64encode(raw).decode(), Image.open(io.BytesIO(raw)),
             {"type": "image", "image": str(path)}, {"type": "image_url", "image_url": {"url": data_url}}]
    for form in forms:
        image = load_image(form)
        assert image.size == (60, 40) and image.mode == "RGB" and image.getpixel((3, 3)) == (255, 0, 0)
    assert load_image(encode_image(load_image(str(path)))).tobytes() == load_image(str(path)).tobytes()


def test_bad_images_are_refused_with_the_reason(tmp_path):
    (tmp_path / "text.png").write_text("not an image at all")
    cases = {
        str(tmp_path / "missing.png"): "image file not found",
        "https://example.com/cat.png": "remote image URLs are not fetched",
        str(tmp_path / "text.png"): "not a readable image",
        "data:image/png;base64," + base64.b64encode(b"garbage" * 10).decode(): "not a readable image",
    }
    for item, reason in cases.items():
        with pytest.raises(MediaError, match=reason):
            load_image(item)
    big = tmp_path / "big.png"
    Image.new("RGB", (8, 8)).save(big)
    with pytest.raises(MediaError, match="more than the 32-pixel limit"):
        load_image(str(big), max_pixels=32)
    with pytest.raises(MediaError, match="more than the 10-byte limit"):
        load_image(str(big), max_bytes=10)
    assert MAX_IMAGE_PIXELS < Image.MAX_IMAGE_PIXELS  # refused by us before PIL's own bomb check


def test_processor_expands_each_placeholder_to_the_grid(tiny_vlm_dir):
    processor = load_processor(tiny_vlm_dir)
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    messages = [{"role": "user", "content": [{"type": "image", "image": "a"}, {"type": "text", "text": "and"},
                                             {"type": "image", "image": "b"}, {"type": "text", "text": "count"}]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    small, large = Image.new("RGB", (56, 56)), Image.new("RGB", (112, 112))
    ids, train_inputs = process_images(processor, prompt, [small, large])
    assert train_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8]]
    assert train_inputs["pixel_values"].shape[0] == 16 + 64  # patches of both images
    runs = [len(run) for run in "".join("x" if t == pad else " " for t in ids).split()]
    assert runs == [4, 16]  # (4x4 patches)/(2x2 merge), (8x8)/(2x2)
    assert tokenizer.decode([t for t in ids if t != pad]) == prompt.replace("<|image_pad|>", "")


def test_prompt_length_filter_counts_each_image_at_its_expanded_size(tiny_vlm_dir, tmp_path):
    """--rollout-max-prompt-len drops a prompt whose images expand past the limit, though its text and
    one placeholder per image would fit; the count is the processor's own expansion."""
    import json

    from slime.utils.data import Dataset
    from slime.utils.multimodal import expanded_prompt_length

    processor = load_processor(tiny_vlm_dir)
    tokenizer = processor.tokenizer
    for size in ((56, 56), (112, 112), (200, 90)):
        path = tmp_path / f"{size[0]}x{size[1]}.png"
        Image.new("RGB", size).save(path)
    rows = [{"prompt": "<image>count", "images": [str(tmp_path / "56x56.png")]},
            {"prompt": "<image>count", "images": [str(tmp_path / "112x112.png")]},
            {"prompt": "<image><image>count", "images": [str(tmp_path / "56x56.png"), str(tmp_path / "200x90.png")]},
            {"prompt": "<image>count", "images": [str(tmp_path / "missing.png")]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    kwargs = dict(prompt_key="prompt", multimodal_keys={"image": "images"}, apply_chat_template=True)
    full = Dataset(str(data), tokenizer, processor, None, **kwargs)
    lengths = []
    for sample in full.samples[:3]:
        images = [Image.open(item) for item in sample.multimodal_inputs["images"]]
        ids, _ = process_images(processor, sample.prompt, images)
        text = len(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
        assert expanded_prompt_length(text, sample.multimodal_inputs["images"], processor) == len(ids)
        lengths.append(len(ids))
    assert lengths[0] < lengths[1] and lengths[0] < lengths[2]
    limit = lengths[0]  # the one-placeholder text of every row fits; only the first row's images do
    kept = Dataset(str(data), tokenizer, processor, limit, **kwargs)
    assert [s.multimodal_inputs["images"][-1].rsplit("/", 1)[-1] for s in kept.samples] == ["56x56.png", "missing.png"]
    assert kept.dropped_by_length == 2  # a missing image is not dropped here: it fails its sample with the reason

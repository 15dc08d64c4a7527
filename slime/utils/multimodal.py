"""Images in prompts: loading them safely, encoding them for the engine, and running the model's processor.

An image item of a prompt is a local path (or ``file://`` URL), a base64 data URL
(``data:image/png;base64,...``), raw base64, a PIL image, or a chat part holding one of those
(``{"type": "image", "image": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``). Remote
``http(s)://`` URLs are refused: the machines slime runs on fetch nothing at rollout time. Every
refusal is a :class:`MediaError` whose message names the item and the reason; the default generator
fails that one sample with it and the run goes on.

:func:`process_images` runs the checkpoint's processor (Hugging Face ``AutoProcessor``; or, where
that cannot load, e.g. a Qwen-VL processor without torchvision for its video half,
:class:`ImageTextProcessor`, the same image processor and placeholder expansion) and returns the
expanded prompt ids and the trainer's inputs (``pixel_values``, ``image_grid_thw``).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

#: an image file larger than this is refused before it is read
MAX_IMAGE_BYTES = 32 << 20
#: an image with more pixels than this is refused before it is decoded (PIL's decompression-bomb bound is 89M)
MAX_IMAGE_PIXELS = 32 << 20

_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,(?P<data>.*)$", re.S)
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]+$")


def is_vision_language(config) -> bool:
    """Whether a Hugging Face config is an image-text model with image placeholder tokens (Qwen-VL style)."""
    return getattr(config, "vision_config", None) is not None and hasattr(config, "image_token_id")


class MediaError(ValueError):
    """An image that cannot be used: missing, remote, unreadable or too large (the message says which)."""


def _describe(item) -> str:
    text = item if isinstance(item, str) else type(item).__name__
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def unwrap_image(item):
    """The image source inside a chat part (``image`` / ``image_url`` / ``url`` / ``path`` key), or ``item``."""
    if isinstance(item, dict):
        for key in ("image", "image_url", "url", "path"):
            if item.get(key) is not None:
                return unwrap_image(item[key])
        raise MediaError(f"image part {sorted(item)!r} holds no image (expected an 'image' or 'image_url' key)")
    return item


def _resolve(item):
    """What an image item denotes, without decoding it: ``(PIL image | bytes | local file path, description)``;
    raises :class:`MediaError` naming the item and the reason where it denotes nothing usable."""
    from PIL import Image

    source = unwrap_image(item)
    if isinstance(source, Image.Image):
        return source, source
    if isinstance(source, (bytes, bytearray)):
        return bytes(source), "image bytes"
    if not isinstance(source, str):
        raise MediaError(f"image {_describe(source)}: expected a path, a data URL, base64 or a PIL image")
    if source.startswith(("http://", "https://")):
        raise MediaError(f"image {_describe(source)}: remote image URLs are not fetched (no network at rollout); "
                         "download the image and give its local path or a base64 data URL")
    match = _DATA_URL.match(source)
    if match:
        return _b64(match["data"], source), source
    path = source[len("file://"):] if source.startswith("file://") else source
    if os.path.exists(path):
        return Path(path), path
    if len(source) >= 64 and _BASE64.match(source):  # raw base64, as SGLang accepts it (a path has a '.')
        return _b64(source, source), source
    raise MediaError(f"image file not found: {_describe(path)}")


def load_image(item, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS):
    """The RGB PIL image ``item`` denotes; raises :class:`MediaError` naming the item and the reason."""
    from PIL import Image

    value, where = _resolve(item)
    if isinstance(value, Image.Image):
        return _checked(value, where, max_pixels).convert("RGB")
    if isinstance(value, Path):
        size = value.stat().st_size
        if size > max_bytes:
            raise MediaError(f"image file {where}: {size} bytes, more than the {max_bytes}-byte limit")
        value = value.read_bytes()
    return _decode(value, where, max_bytes, max_pixels)


def _b64(data: str, source: str) -> bytes:
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"image {_describe(source)}: invalid base64 ({e})") from None


def _decode(raw: bytes, source, max_bytes: int, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    if len(raw) > max_bytes:
        raise MediaError(f"image {_describe(source)}: {len(raw)} bytes, more than the {max_bytes}-byte limit")
    try:
        image = Image.open(io.BytesIO(raw))  # reads the header only: the size is known before decoding
        _checked(image, source, max_pixels)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise MediaError(f"image {_describe(source)}: not a readable image ({type(e).__name__}: {e})") from None
    return image.convert("RGB")


def _checked(image, source, max_pixels: int):
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"image {_describe(source)}: {width}x{height} pixels, more than the {max_pixels}-pixel limit")
    if width < 1 or height < 1:
        raise MediaError(f"image {_describe(source)}: empty ({width}x{height})")
    return image


def image_size(item) -> tuple[int, int] | None:
    """``(width, height)`` of an image item from its header alone (no pixels decoded), or None where it
    cannot be read now: such a sample fails with the reason when it is generated."""
    from PIL import Image

    try:
        value, _ = _resolve(item)
        if isinstance(value, Image.Image):
            return value.size
        with Image.open(value if isinstance(value, Path) else io.BytesIO(value)) as image:
            return image.size
    except (MediaError, OSError, SyntaxError, ValueError):
        return None


def image_token_count(processor, width: int, height: int) -> int:
    """How many placeholder tokens the processor expands one ``width`` x ``height`` image into."""
    image_processor = processor.image_processor
    merge = image_processor.merge_size ** 2
    if hasattr(image_processor, "get_number_of_image_patches"):
        return image_processor.get_number_of_image_patches(height, width) // merge
    from PIL import Image

    return image_inputs(processor, [Image.new("RGB", (width, height))])[1][0]


def expanded_prompt_length(text_length: int, images: list, processor) -> int:
    """A prompt's token count once each image's one placeholder becomes its tokens (images whose size
    cannot be read count as their placeholder)."""
    for item in images:
        size = image_size(item)
        if size is not None:
            text_length += image_token_count(processor, *size) - 1
    return text_length


def encode_image(image) -> str:
    """A PNG data URL of a PIL image: what the default generator sends as ``image_data``."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def images_of_messages(messages) -> list:
    """The image items of chat messages, in order (parts typed ``image`` / ``image_url``)."""
    items = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            items += [part for part in content if isinstance(part, dict)
                      and (part.get("type") in ("image", "image_url") or "image" in part or "image_url" in part)]
    return items


class ImageTextProcessor:
    """The processor of a Qwen-VL style checkpoint built from its tokenizer and image processor: each
    image placeholder token of the text becomes ``grid_t*grid_h*grid_w / merge_size**2`` copies, as the
    Hugging Face processor does. Used where ``AutoProcessor`` cannot load (its video processor needs
    torchvision); images only."""

    def __init__(self, tokenizer, image_processor, image_token: str = "<|image_pad|>"):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, text=None, images=None, return_tensors="pt", **kwargs):
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        features = {}
        if images:
            features = dict(self.image_processor(images=images, return_tensors=return_tensors))
            merge = self.image_processor.merge_size ** 2
            counts = iter([int(g.prod()) // merge for g in features["image_grid_thw"]])
            marker = "\x00image\x00"
            texts = [t.replace(self.image_token, marker) for t in texts]
            texts = [re.sub(re.escape(marker), lambda m: self.image_token * next(counts), t) for t in texts]
        encoded = self.tokenizer(texts, add_special_tokens=False, return_tensors=return_tensors, padding=True)
        return BatchFeature({**encoded, **features})


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int],
                        mask: list[int] | None = None) -> tuple[list[int], list[int] | None]:
    """Each run of image placeholder tokens in ``ids`` becomes ``counts[i]`` copies (a run of one is
    expanded, a run of the right length kept); ``mask`` (one entry per id) grows with 0s. Raises
    :class:`MediaError` when the runs and the images do not pair up."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == image_token_id:
            j = i
            while j < len(ids) and ids[j] == image_token_id:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    if len(runs) != len(counts):
        raise MediaError(f"{len(counts)} images for {len(runs)} image placeholders (token {image_token_id}) in the prompt")
    out, out_mask, last = [], [] if mask is not None else None, 0
    for (start, end), count in zip(runs, counts):
        if end - start not in (1, count):
            raise MediaError(f"an image of {count} tokens has a placeholder run of {end - start} tokens; send one "
                             "placeholder per image or the processor's expanded prompt")
        out += ids[last:start] + [image_token_id] * count
        if mask is not None:
            out_mask += mask[last:start] + [0] * count
        last = end
    out += ids[last:]
    if mask is not None:
        out_mask += mask[last:]
    return out, out_mask


def image_inputs(processor, images: list) -> tuple[dict, list[int]]:
    """The trainer's inputs of PIL ``images`` (``pixel_values``, ``image_grid_thw``) and each image's token count."""
    image_processor = processor.image_processor
    out = dict(image_processor(images=images, return_tensors="pt"))
    merge = image_processor.merge_size ** 2
    return out, [int(g.prod()) // merge for g in out["image_grid_thw"]]


def fallback_processor(name_or_path: str, tokenizer):
    """:class:`ImageTextProcessor` of a checkpoint that has an image processor config (with ``tokenizer``,
    the checkpoint's), else None."""
    from transformers import AutoImageProcessor

    if not os.path.exists(os.path.join(name_or_path, "preprocessor_config.json")):
        return None
    image_processor = AutoImageProcessor.from_pretrained(name_or_path)
    if not hasattr(image_processor, "merge_size"):
        return None  # not a Qwen-VL style image processor: the placeholder expansion would be guessed
    return ImageTextProcessor(tokenizer, image_processor)


def process_images(processor, prompt_text: str, images: list) -> tuple[list[int], dict]:
    """Run ``processor`` on a rendered prompt (one placeholder per image) and its PIL images:
    ``(expanded prompt ids, {"pixel_values", "image_grid_thw", ...})`` without ids and attention mask."""
    out = processor(text=[prompt_text], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    train_inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    return ids, train_inputs


def sample_images(sample) -> list:
    """The image items of a sample: ``multimodal_inputs["images"]``, else the image parts of its message prompt."""
    images = (sample.multimodal_inputs or {}).get("images")
    if images is None:
        images = images_of_messages(sample.prompt)
    return list(images or [])


def prepare_prompt(sample, tokenizer, processor) -> tuple[list, str]:
    """Load a multimodal sample's images and, on its first call, set ``sample.tokens`` (the prompt with
    each image's placeholders expanded) and ``sample.multimodal_train_inputs``. Returns the loaded PIL
    images and the rendered prompt (one placeholder per image); raises :class:`MediaError` for an image
    that cannot be used."""
    images = [load_image(item) for item in sample_images(sample)]
    if processor is None:
        raise MediaError("the prompt has images but the checkpoint has no image processor "
                         "(preprocessor_config.json): serve a vision-language checkpoint")
    prompt = sample.prompt
    if isinstance(prompt, list):  # un-templated chat messages with typed image parts
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                               **(sample.apply_chat_template_kwargs or {}))
    placeholders = prompt.count(processor.image_token)
    if placeholders != len(images):
        raise MediaError(f"the prompt has {placeholders} {processor.image_token} placeholders for {len(images)} "
                         "images: render it with the checkpoint's chat template (--apply-chat-template)")
    if not sample.tokens:
        sample.tokens, sample.multimodal_train_inputs = process_images(processor, prompt, images)
    return images, prompt

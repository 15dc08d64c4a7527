"""Prompt datasets: reading ``.jsonl`` / ``.parquet`` files and turning rows into :class:`Sample` s.

Format (docs/INTERFACES.md §7.1): one object per row; ``path@[start:end]`` slices the row stream (either
bound optional, negative bounds allowed). Row → Sample: prompt from ``--input-key`` (string, or a
chat-message list), label from ``--label-key``, metadata from ``--metadata-key`` (dict or JSON
string), tools from ``--tool-key`` (list or JSON string, stored as ``metadata["tools"]``),
optional chat templating and multimodal placeholders. Every bad row raises with the file, the
line (jsonl) / row (parquet) number and the key involved.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
from typing import Any, Iterator

from slime.utils.multimodal import expanded_prompt_length, sample_images
from slime.utils.types import MultimodalTypes, Sample

logger = logging.getLogger(__name__)

_SLICE_RE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


def _parse_path_slice(path: str) -> tuple[str, int | None, int | None]:
    """Split ``file@[start:end]`` into ``(file, start, end)``; no suffix gives ``(file, None, None)``."""
    match = _SLICE_RE.match(path)
    if not match:
        return path, None, None
    start = int(match["start"]) if match["start"] else None
    end = int(match["end"]) if match["end"] else None
    return match["path"], start, end


def _iter_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:  # bytes, so that an encoding error can name its line
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                 f"save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: malformed JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}")
            yield line_no, row


def _iter_parquet(path: str) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    row_no = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            row_no += 1
            yield row_no, row


def iter_rows(path: str) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_or_row_number, row)`` of a prompt file, honouring an ``@[start:end]`` suffix."""
    file_path, start, end = _parse_path_slice(path)
    if not os.path.exists(file_path):
        raise FileNotFoundError(f"prompt data file not found: {file_path}")
    if file_path.endswith(".jsonl"):
        rows = _iter_jsonl(file_path)
    elif file_path.endswith(".parquet"):
        rows = _iter_parquet(file_path)
    else:
        raise ValueError(f"unsupported prompt data format {file_path!r}: expected a .jsonl or .parquet file")
    if start is None and end is None:
        yield from rows
    elif (start or 0) >= 0 and (end is None or end >= 0):
        yield from itertools.islice(rows, start or 0, end)
    else:  # negative bounds need the row count
        yield from list(rows)[start:end]


def read_file(path: str) -> Iterator[dict]:
    """Yield the rows (dicts) of a ``.jsonl`` / ``.parquet`` file, with optional ``@[start:end]`` slicing."""
    for _, row in iter_rows(path):
        yield row


def get_source(sample: Sample) -> str:
    """Data-source label of a sample: ``sample.source`` if set, else ``metadata["source_name"]``, else "unknown"."""
    source = getattr(sample, "source", None)
    if source:
        return str(source)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    return str(metadata.get("source_name") or "unknown")


def _as_list(value, what: str, where: str) -> list:
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {what} is a string but not valid JSON ({e.msg})") from None
    if not isinstance(value, list):
        raise ValueError(f"{where}: {what} must be a list (or its JSON string), got {type(value).__name__}")
    return value


def _split_multimodal(messages: list[dict], row: dict, multimodal_keys: dict, where: str):
    """Replace ``<image>``-style placeholders in string contents by typed parts; return raw media."""
    media: dict[str, list] = {}
    queues = {}
    for media_type, data_key in multimodal_keys.items():
        mm_type = MultimodalTypes.get(media_type)
        if mm_type is None:
            raise ValueError(f"--multimodal-keys: unknown media type {media_type!r}; expected image, video or audio")
        if data_key not in row:
            raise KeyError(f"{where}: missing multimodal key {data_key!r} (for {media_type})")
        queues[mm_type] = list(_as_list(row[data_key], f"multimodal field {data_key!r}", where))
    pattern = "(" + "|".join(re.escape(t.placeholder) for t in queues) + ")"
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            logger.warning("%s: message content is already a list; leaving it as is", where)
            out.append(message)
            continue
        parts = []
        for piece in re.split(pattern, content):
            mm_type = next((t for t in queues if t.placeholder == piece), None)
            if mm_type is None:
                if piece:
                    parts.append({"type": "text", "text": piece})
                continue
            if not queues[mm_type]:
                raise ValueError(f"{where}: more {mm_type.placeholder} placeholders than items in the data field")
            item = queues[mm_type].pop(0)
            parts.append(item if isinstance(item, dict) else {"type": mm_type.name, mm_type.name: item})
            media.setdefault(mm_type.name + "s", []).append(item)
        out.append({**message, "content": parts})
    leftover = {t.name: len(q) for t, q in queues.items() if q}
    if leftover:
        raise ValueError(f"{where}: media items without a placeholder: {leftover}")
    return out, media


class Dataset:
    """A list of prompt :class:`Sample` s loaded from one file, with optional per-epoch shuffling."""

    def __init__(
        self,
        path: str,
        tokenizer=None,
        processor=None,
        max_length: int | None = None,
        *,
        prompt_key: str = "input",
        label_key: str | None = None,
        tool_key: str | None = "tools",
        metadata_key: str = "metadata",
        multimodal_keys: dict | str | None = None,
        seed: int = 42,
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict | str | None = None,
    ):
        if isinstance(multimodal_keys, str):
            multimodal_keys = json.loads(multimodal_keys)
        if isinstance(apply_chat_template_kwargs, str):
            apply_chat_template_kwargs = json.loads(apply_chat_template_kwargs or "{}")
        if apply_chat_template and tokenizer is None:
            raise ValueError("--apply-chat-template needs a tokenizer (set --hf-checkpoint)")
        self.path = path
        self.seed = seed
        self.tokenizer = tokenizer
        self.processor = processor
        self.origin_samples: list[Sample] = []
        dropped = 0
        for line_no, row in iter_rows(path):
            sample = self._row_to_sample(
                row,
                f"{path} line {line_no}",
                prompt_key=prompt_key,
                label_key=label_key,
                tool_key=tool_key,
                metadata_key=metadata_key,
                multimodal_keys=multimodal_keys,
                apply_chat_template=apply_chat_template,
                apply_chat_template_kwargs=apply_chat_template_kwargs or {},
            )
            if max_length is not None and self._too_long(sample, max_length):
                dropped += 1
                continue
            self.origin_samples.append(sample)
        if max_length is not None and dropped:
            if not self.origin_samples:
                raise ValueError(f"{path}: every prompt ({dropped}) is longer than {max_length} tokens, the longest "
                                 f"prompt the engines accept (--rollout-max-prompt-len, or the context length - 1): "
                                 f"raise --rollout-max-context-len / --sglang-context-length or shorten the prompts")
            logger.warning("%s: dropped %d prompts longer than %d tokens (--rollout-max-prompt-len, or the context "
                           "length - 1); %d remain", path, dropped, max_length, len(self.origin_samples))
        self.dropped_by_length = dropped
        self.samples = self.origin_samples

    def _row_to_sample(
        self,
        row: dict,
        where: str,
        *,
        prompt_key,
        label_key,
        tool_key,
        metadata_key,
        multimodal_keys,
        apply_chat_template,
        apply_chat_template_kwargs,
    ) -> Sample:
        if prompt_key not in row:
            raise KeyError(f"{where}: missing input key {prompt_key!r} (--input-key); row keys: {sorted(row)}")
        prompt = row[prompt_key]
        if hasattr(prompt, "tolist"):
            prompt = prompt.tolist()
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"{where}: input key {prompt_key!r} must be a string or a list of chat messages")
        if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise ValueError(f"{where}: input key {prompt_key!r} holds a list that is not chat messages with 'role'")

        metadata: Any = row.get(metadata_key) if metadata_key else None
        if metadata is None:
            metadata = {}
        elif isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: metadata key {metadata_key!r} is a string but not valid JSON ({e.msg})") from None
        if not isinstance(metadata, dict):
            raise ValueError(f"{where}: metadata key {metadata_key!r} must be an object, got {type(metadata).__name__}")
        metadata = dict(metadata)

        tools = None
        if tool_key and row.get(tool_key) is not None:
            tools = _as_list(row[tool_key], f"tool key {tool_key!r}", where)
            metadata["tools"] = tools

        if label_key:
            if label_key not in row:
                raise KeyError(f"{where}: missing label key {label_key!r} (--label-key); row keys: {sorted(row)}")
            label = row[label_key]
        else:
            label = None

        multimodal_inputs = None
        as_messages = apply_chat_template or bool(multimodal_keys) or isinstance(prompt, list)
        if as_messages:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if multimodal_keys:
                messages, multimodal_inputs = _split_multimodal(messages, row, multimodal_keys, where)
            if apply_chat_template:
                prompt = self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True, **apply_chat_template_kwargs
                )
            else:
                prompt = messages
        return Sample(
            prompt=prompt,
            label=label,
            metadata=metadata,
            multimodal_inputs=multimodal_inputs or None,
            apply_chat_template_kwargs=dict(apply_chat_template_kwargs),
        )

    def _too_long(self, sample: Sample, max_length: int) -> bool:
        if not isinstance(sample.prompt, str):
            if not getattr(self, "_warned_list_prompt", False):
                logger.warning("%s: prompts are message lists; --rollout-max-prompt-len does not filter them", self.path)
                self._warned_list_prompt = True
            return False
        images = sample_images(sample) if self.processor is not None else []
        if not images and len(sample.prompt.encode("utf-8")) + 1 <= max_length:
            return False  # a token spans >= 1 byte (+1: a tokenizer's prefix space): fits without tokenizing
        if self.tokenizer is None:
            raise ValueError("prompt-length filtering needs a tokenizer (set --hf-checkpoint)")
        length = len(self.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
        if images:  # each image's placeholder becomes as many tokens as its size gives
            length = expanded_prompt_length(length, images, self.processor)
        return length > max_length

    def shuffle(self, new_epoch_id: int) -> None:
        """Permute the samples with ``random.Random(seed + epoch)`` (reproducible per epoch)."""
        order = list(range(len(self.origin_samples)))
        random.Random(self.seed + new_epoch_id).shuffle(order)
        self.samples = [self.origin_samples[i] for i in order]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> Sample:
        return self.samples[idx]

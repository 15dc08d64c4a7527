"""Prompt-file reading: formats, slicing, keys, chat templates, length filter, shuffling, bad input."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime.utils.data import Dataset, get_source, read_file
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.processing_utils import load_processor, load_tokenizer
from slime.utils.types import Sample

ROWS = [
    {"input": f"question {i}", "label": str(i), "metadata": {"source_name": "src"} if i % 2 else json.dumps({"k": i})}
    for i in range(10)
]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return str(path)


def test_read_jsonl_and_parquet_with_slices(tmp_path):
    jsonl = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    parquet = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"input": r["input"], "label": r["label"]} for r in ROWS]), parquet)
    for path in (jsonl, parquet):
        assert [r["label"] for r in read_file(path)] == [str(i) for i in range(10)]
        assert [r["label"] for r in read_file(path + "@[2:4]")] == ["2", "3"]
        assert [r["label"] for r in read_file(path + "@[-2:]")] == ["8", "9"]
        assert [r["label"] for r in read_file(path + "@[:1]")] == ["0"]
        assert [r["label"] for r in read_file(path + "@[7:-1]")] == ["7", "8"]


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        list(read_file(str(tmp_path / "missing.jsonl")))
    (tmp_path / "d.csv").write_text("a")
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        list(read_file(str(tmp_path / "d.csv")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a"}\n{"input": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed JSON line"):
        list(read_file(str(bad)))


def test_rows_to_samples_keys_and_errors(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    ds = Dataset(path, prompt_key="input", label_key="label", metadata_key="metadata")
    assert len(ds) == 10
    assert ds[0].prompt == "question 0" and ds[0].label == "0" and ds[0].metadata == {"k": 0}
    assert get_source(ds[1]) == "src" and get_source(ds[0]) == "unknown"
    ds[0].source = "dyn"
    assert get_source(ds[0]) == "dyn"
    with pytest.raises(KeyError, match=r"d.jsonl line 1: missing label key 'answer' \(--label-key\)"):
        Dataset(path, prompt_key="input", label_key="answer")
    with pytest.raises(KeyError, match=r"line 1: missing input key 'prompt' \(--input-key\)"):
        Dataset(path, prompt_key="prompt")
    bad_md = _write_jsonl(tmp_path / "m.jsonl", [{"input": "a", "metadata": "{not json"}])
    with pytest.raises(ValueError, match=r"m.jsonl line 1: metadata key 'metadata' is a string but not valid JSON"):
        Dataset(bad_md, prompt_key="input")
    bad_tools = _write_jsonl(tmp_path / "t.jsonl", [{"input": "a"}, {"input": "b", "tools": {"x": 1}}])
    with pytest.raises(ValueError, match=r"t.jsonl line 2: tool key 'tools' must be a list"):
        Dataset(bad_tools, prompt_key="input")


def test_chat_template_tools_and_length_filter(tmp_path, tiny_model_dir, caplog):
    tok = load_tokenizer(tiny_model_dir)
    assert load_processor(tiny_model_dir) is None
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "tools": json.dumps(tools)},
        {"messages": "short"},
        {"messages": "a much longer prompt " * 300},
    ]
    path = _write_jsonl(tmp_path / "c.jsonl", rows)
    with caplog.at_level(logging.INFO):
        ds = Dataset(path, tok, None, 1000, prompt_key="messages", apply_chat_template=True,
                     apply_chat_template_kwargs='{"enable_thinking": false}')  # fmt: skip
    assert len(ds) == 2 and ds.dropped_by_length == 1
    assert "dropped 1 prompts longer than 1000 tokens" in caplog.text
    assert ds[0].metadata["tools"] == tools and "<tools>" in ds[0].prompt
    assert ds[1].prompt == "<|im_start|>user\nshort<|im_end|>\n<|im_start|>assistant\n"
    raw = Dataset(path, prompt_key="messages")
    assert raw[0].prompt == [{"role": "user", "content": "hi"}] and raw[1].prompt == "short"


def test_shuffle_is_seeded_per_epoch(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    a, b = Dataset(path, seed=1), Dataset(path, seed=1)
    a.shuffle(3)
    b.shuffle(3)
    assert [s.prompt for s in a.samples] == [s.prompt for s in b.samples]
    b.shuffle(4)
    assert [s.prompt for s in a.samples] != [s.prompt for s in b.samples]
    assert sorted(s.prompt for s in b.samples) == sorted(r["input"] for r in ROWS)


def test_multimodal_placeholders(tmp_path):
    path = _write_jsonl(tmp_path / "mm.jsonl", [{"input": "see <image> and <image>", "images": ["a.png", "b.png"]}])
    ds = Dataset(path, multimodal_keys='{"image": "images"}')
    assert ds[0].prompt[0]["content"] == [
        {"type": "text", "text": "see "}, {"type": "image", "image": "a.png"},
        {"type": "text", "text": " and "}, {"type": "image", "image": "b.png"},
    ]  # fmt: skip
    assert ds[0].multimodal_inputs == {"images": ["a.png", "b.png"]}
    path = _write_jsonl(tmp_path / "mm2.jsonl", [{"input": "<image>", "images": ["a.png", "b.png"]}])
    with pytest.raises(ValueError, match="media items without a placeholder"):
        Dataset(path, multimodal_keys={"image": "images"})


def test_multi_turn_loss_mask(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    gen = MultiTurnLossMaskGenerator(tok, tokenizer_type="qwen")
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "skip me", "step_loss_mask": 0},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "a3"},
    ]
    ids, mask = gen.get_loss_mask(messages)
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == full and len(ids) == len(mask)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "a1<|im_end|>a3<|im_end|>"
    assert gen.get_response_lengths([mask, [0, 0]]) == [len(mask) - mask.index(1), 0]
    with pytest.raises(ValueError, match="unknown --loss-mask-type"):
        MultiTurnLossMaskGenerator(tok, tokenizer_type="llama")
    assert isinstance(Sample(), Sample)

"""The viewer's data model on small dumps: rows, lanes, open spans, untraced samples, bad files."""

import json

import pytest
import torch

from slime.observability import trace_utils as tu
from slime.observability.trace_timeline import build_timeline, load_dump, write_viewer
from slime.utils.types import Sample


def traced_sample(index, group):
    sample = Sample(index=index, group_index=group, tokens=[1], status=Sample.Status.COMPLETED, reward=float("nan"))
    with tu.trace_span(sample, "generate_and_rm"):
        with tu.trace_span(sample, "sglang_generate") as span:
            span.update(tu.build_sglang_meta_trace_attrs({"queue_time": 0.01, "prefill_duration": 0.02,
                                                          "decode_duration": 0.03}))
        tu.trace_event(sample, "dynamic_filter", attrs={"keep": True})
    return sample


def test_rows_lanes_open_spans_and_untraced(tmp_path):
    finished = traced_sample(1, 0)
    interrupted = Sample(index=2, group_index=0, tokens=[1])
    tu.trace_span(interrupted, "generate_and_rm").__enter__()  # never exited: the process stopped mid-span
    untraced = Sample(index=3, group_index=1)
    path = tmp_path / "0.pt"
    torch.save({"rollout_id": 0, "samples": [s.to_dict() for s in (untraced, interrupted, finished)]}, path)

    cache, page, timeline = write_viewer(path)
    assert cache.name == "0.trace_timeline_cache.json" and page.name == "0.trace_timeline_viewer.html"
    assert timeline["num_samples"] == 3 and timeline["untraced_samples"] == 1
    first, second = timeline["rows"]
    assert (first["sample_id"], second["sample_id"]) == (1, 2)
    lanes = {s["name"]: s["lane"] for s in first["spans"]}
    assert lanes == {"generate_and_rm": "0", "sglang_generate": "1", "sglang_queue": "queue",
                     "sglang_prefill": "prefill", "sglang_decode": "decode"}
    prefill = next(s for s in first["spans"] if s["name"] == "sglang_prefill")
    assert prefill["end"] - prefill["start"] == pytest.approx(0.02)
    assert first["events"][0]["name"] == "dynamic_filter" and first["events"][0]["attrs"] == {"keep": True}
    (open_span,) = second["spans"]
    assert open_span.get("open") is True and open_span["end"] == pytest.approx(timeline["duration"])
    assert json.loads(cache.read_text())["rows"][0]["reward"] is None  # NaN reward: null for JSON.parse
    assert "__TIMELINE_JSON__" not in page.read_text() and "NaN" not in cache.read_text()


def test_bad_dumps_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_dump(tmp_path / "missing.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a rollout debug dump"):
        load_dump(tmp_path / "list.pt")
    assert build_timeline({"samples": []})["rows"] == []

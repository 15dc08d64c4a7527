"""Rollout dump -> timeline: the data model behind ``tools/trace_timeline_viewer.py``.

Reads a ``--save-debug-rollout-data`` dump (docs/INTERFACES.md §7.5), pairs each sample's ``span_start`` /
``span_end`` records into bars and keeps instant events as markers. Each sample is one row; inside a
row a span sits in a lane: the depth of its nesting, except engine phases, which get named lanes
(``prefill``, ``decode``, ``queue``) so the prefill/decode split of every request lines up across rows.
Times are seconds relative to the earliest record of the dump.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

PHASE_LANES = {"sglang_queue": "queue", "sglang_prefill": "prefill", "sglang_decode": "decode",
               "sglang_pd_prefill": "prefill", "sglang_pd_decode": "decode"}
CACHE_VERSION = 1


def load_dump(path: str | Path) -> dict:
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such rollout dump (write one with --save-debug-rollout-data)")
    payload = torch.load(path, weights_only=False, map_location="cpu")
    if not isinstance(payload, dict) or not isinstance(payload.get("samples"), list):
        raise ValueError(f"{path}: not a rollout debug dump; expected {{'rollout_id': ..., 'samples': [...]}}, "
                         f"got {type(payload).__name__} with keys {list(payload)[:5] if isinstance(payload, dict) else '-'}")
    return payload


def _sample_row(position: int, sample: dict) -> dict | None:
    trace = sample.get("trace")
    if not isinstance(trace, dict) or not trace.get("events"):
        return None
    starts, spans, markers = {}, [], []
    for event in trace["events"]:
        kind = event.get("type")
        if kind == "span_start":
            starts[event.get("span_id")] = event
        elif kind == "span_end" and event.get("span_id") in starts:
            start = starts.pop(event["span_id"])
            spans.append({"id": event["span_id"], "parent": start.get("parent_span_id"), "name": start["name"],
                          "start": start["ts"], "end": event["ts"], "attempt": start.get("attempt", 0),
                          "attrs": {**(start.get("attrs") or {}), **(event.get("attrs") or {})},
                          "error": bool((event.get("attrs") or {}).get("error_type"))})
        elif kind == "event":
            markers.append({"name": event["name"], "ts": event["ts"], "attempt": event.get("attempt", 0),
                            "parent": event.get("parent_span_id"), "attrs": event.get("attrs") or {}})
    for start in starts.values():  # never ended (the process stopped mid-span): open until the last record
        spans.append({"id": start.get("span_id"), "parent": start.get("parent_span_id"), "name": start["name"],
                      "start": start["ts"], "end": None, "attempt": start.get("attempt", 0),
                      "attrs": start.get("attrs") or {}, "error": False, "open": True})
    _assign_lanes(spans)
    reward = sample.get("reward")
    return {"position": position, "sample_id": trace.get("sample_id", sample.get("index")),
            "group_id": trace.get("group_id", sample.get("group_index")), "trace_id": trace.get("trace_id"),
            "attempts": int(trace.get("attempt", 0)) + 1, "status": sample.get("status"),
            "reward": reward if isinstance(reward, (int, float)) or reward is None else str(reward),
            "response_length": sample.get("response_length"), "spans": spans, "events": markers}


def _assign_lanes(spans: list[dict]) -> None:
    """Depth lanes ("0", "1", ...) for ordinary spans; named lanes for engine phases and their parts."""
    by_id = {s["id"]: s for s in spans}

    def depth(span, seen=()):
        parent = by_id.get(span["parent"])
        return 0 if parent is None or span["id"] in seen else 1 + depth(parent, (*seen, span["id"]))

    def phase(span):
        while span is not None:
            if span["name"] in PHASE_LANES:
                return PHASE_LANES[span["name"]]
            span = by_id.get(span["parent"])
        return None

    for span in spans:
        span["lane"] = phase(span) or str(depth(span))
        span["depth"] = depth(span)


def build_timeline(payload: dict, source: str = "") -> dict:
    rows = [row for position, sample in enumerate(payload["samples"])
            if (row := _sample_row(position, sample)) is not None]
    times = [t for row in rows for span in row["spans"] for t in (span["start"], span["end"]) if t is not None]
    times += [m["ts"] for row in rows for m in row["events"]]
    origin = min(times) if times else 0.0
    end = max(times) if times else 0.0
    for row in rows:
        for span in row["spans"]:
            span["start"] = span["start"] - origin
            span["end"] = (span["end"] if span["end"] is not None else end) - origin
        for marker in row["events"]:
            marker["ts"] -= origin
        row["spans"].sort(key=lambda s: (s["start"], s["depth"]))
    rows.sort(key=lambda r: (r["group_id"] is None, r["group_id"] or 0, r["sample_id"] is None, r["sample_id"] or 0))
    return {"version": CACHE_VERSION, "source": source, "rollout_id": payload.get("rollout_id"),
            "created": time.strftime("%Y-%m-%d %H:%M:%S"), "origin_ts": origin, "duration": end - origin,
            "num_samples": len(payload["samples"]), "untraced_samples": len(payload["samples"]) - len(rows),
            "rows": rows}


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _finite(value):
    """NaN and infinities (a failed reward, say) become null: the page parses the data with JSON.parse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def timeline_json(timeline: dict) -> str:
    return json.dumps(_finite(timeline), default=_json_default, allow_nan=False)


def render_html(timeline: dict) -> str:
    """The self-contained page: the timeline JSON and the viewer's CSS/JS inline, nothing fetched."""
    template = (Path(__file__).parent / "trace_timeline_viewer.html").read_text()
    data = timeline_json(timeline).replace("</", "<\\/")  # cannot close the <script> element early
    title = f"rollout {timeline.get('rollout_id')} — {Path(timeline.get('source') or 'dump').name}"
    return template.replace("__TITLE__", _escape(title)).replace("__TIMELINE_JSON__", data)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_viewer(dump_path: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path, dict]:
    """Write ``<dump>.trace_timeline_cache.json`` and ``<dump>.trace_timeline_viewer.html`` (next to the
    dump unless ``out_dir``); returns both paths and the timeline."""
    dump_path = Path(dump_path)
    timeline = build_timeline(load_dump(dump_path), source=str(dump_path))
    base = (Path(out_dir) if out_dir else dump_path.parent) / dump_path.stem
    base.parent.mkdir(parents=True, exist_ok=True)
    cache = base.with_name(base.name + ".trace_timeline_cache.json")
    page = base.with_name(base.name + ".trace_timeline_viewer.html")
    cache.write_text(timeline_json(timeline))
    page.write_text(render_html(timeline))
    return cache, page, timeline

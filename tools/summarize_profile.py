"""Summarize an engine profile (a Chrome trace from ``/start_profile`` with ``with_stack``): where a step's
wall time goes on the host and how busy the GPU was.

    python tools/summarize_profile.py /tmp/prof/ngram-TP-0.trace.json [--top 40] [--match slime/]

Prints, as JSON:

* ``wall_ms``: first to last Python event; ``engine_steps`` and ``step_ms_mean``: the engine's ``step``
  calls (``engine.py``) and their mean duration;
* ``gpu_kernel_ms`` (sum of kernel, memcpy and memset durations), ``gpu_span_ms`` (first kernel start to
  last kernel end) and ``gpu_busy_fraction`` = kernel time / span — low means the device waited for the
  host; ``top_kernels``: ``[name, ms]`` by total time;
* ``python_inclusive_ms``: ``[function, ms, calls]`` for Python functions whose name contains ``--match``,
  by inclusive time (a recursive function counts each level).

The profiler's Python tracing slows call-heavy code, so read host times as proportions, not absolute
costs; the kernel times are the device's own. ``bench/spec_decode.py --profile-dir`` and
``tools/profile_rollout.py`` write such traces (gzip-compressed ones are read too).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def summarize(events: list[dict], top: int = 40, match: str = "slime/") -> dict:
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    python = [e for e in complete if e.get("cat") == "python_function"]
    device = [e for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    summary: dict = {}
    if python:
        start = min(e["ts"] for e in python)
        summary["wall_ms"] = (max(e["ts"] + e["dur"] for e in python) - start) / 1e3
        steps = [e for e in python if "engine.py" in e["name"] and e["name"].endswith(": step")]
        summary["engine_steps"] = len(steps)
        summary["step_ms_mean"] = sum(e["dur"] for e in steps) / len(steps) / 1e3 if steps else None
    if device:
        kernel_ms = sum(e["dur"] for e in device) / 1e3
        span_ms = (max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)) / 1e3
        per_name: Counter = Counter()
        for e in device:
            per_name[e["name"]] += e["dur"]
        summary.update(gpu_kernel_ms=kernel_ms, gpu_span_ms=span_ms,
                       gpu_busy_fraction=kernel_ms / span_ms if span_ms else None,
                       top_kernels=[[name[:90], round(us / 1e3, 3)] for name, us in per_name.most_common(top)])
    inclusive: defaultdict = defaultdict(float)
    calls: Counter = Counter()
    for e in python:
        if match in e["name"]:
            name = e["name"][e["name"].find(match):]
            inclusive[name] += e["dur"]
            calls[name] += 1
    ranked = sorted(inclusive.items(), key=lambda item: -item[1])[:top]
    summary["python_inclusive_ms"] = [[name[:120], round(us / 1e3, 3), calls[name]] for name, us in ranked]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome-trace JSON file (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=40, help="kernels and Python functions listed")
    parser.add_argument("--match", default="slime/", help="list Python functions whose name contains this")
    args = parser.parse_args()
    print(json.dumps(summarize(load_events(args.trace), args.top, args.match), indent=1))


if __name__ == "__main__":
    main()

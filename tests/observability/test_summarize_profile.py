"""``tools/summarize_profile.py``: the figures it reads from an engine's Chrome trace (host steps, Python
functions by inclusive time, GPU busy fraction) on a trace whose answers are known, and its command line
on a gzip-compressed file."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "summarize_profile.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("summarize_profile", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def two_steps():
    """Two engine steps of 3 ms (host) each with 1 ms of verify and 0.5 ms of lookups, and 1.5 ms of
    kernels in the 5 ms between the first kernel and the last: the GPU waits 70% of the time."""
    step = "slime/backends/embedded_engine/engine.py(214): step"
    verify = "slime/backends/embedded_engine/speculative/decoder.py(475): _verify"
    lookup = "slime/backends/embedded_engine/speculative/decoder.py(192): ngram_propose"
    events = [{"ph": "M", "name": "process_name"}]  # metadata without a duration is ignored
    for t0 in (0, 4000):
        events += [event("python_function", step, t0, 3000), event("python_function", verify, t0 + 500, 1000),
                   event("python_function", lookup, t0 + 100, 250), event("python_function", lookup, t0 + 350, 250),
                   event("python_function", "<built-in method len>", t0 + 10, 5)]
    events += [event("kernel", "_split_kernel", 600, 500), event("kernel", "nvjet_gemm", 4600, 700),
               event("gpu_memcpy", "Memcpy DtoH", 5300, 300)]
    return events


def test_summary_reads_steps_functions_and_the_gpu_idle_time():
    summary = load_tool().summarize(two_steps(), top=10)
    assert summary["engine_steps"] == 2 and summary["step_ms_mean"] == pytest.approx(3.0)
    assert summary["wall_ms"] == pytest.approx(7.0)
    assert summary["gpu_kernel_ms"] == pytest.approx(1.5) and summary["gpu_span_ms"] == pytest.approx(5.0)
    assert summary["gpu_busy_fraction"] == pytest.approx(0.3)
    assert summary["top_kernels"][0] == ["nvjet_gemm", 0.7]
    functions = {name: (ms, calls) for name, ms, calls in summary["python_inclusive_ms"]}
    assert functions["slime/backends/embedded_engine/speculative/decoder.py(192): ngram_propose"] == (1.0, 4)
    assert functions["slime/backends/embedded_engine/speculative/decoder.py(475): _verify"] == (2.0, 2)
    assert not any("len" in name for name in functions)  # only names under --match
    order = [name for name, _, _ in summary["python_inclusive_ms"]]
    assert order[0].endswith(": step")  # by inclusive time


def test_command_line_reads_a_gzip_trace(tmp_path):
    path = tmp_path / "ngram-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": two_steps()}, f)
    done = subprocess.run([sys.executable, str(TOOL), str(path), "--match", "decoder.py"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert [name for name, _, _ in summary["python_inclusive_ms"]] == ["decoder.py(475): _verify",
                                                                      "decoder.py(192): ngram_propose"]
    assert summary["gpu_busy_fraction"] == pytest.approx(0.3)

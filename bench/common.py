"""Shared by the benchmarks: the results file (docs/performance.md: one file per benchmark, machine, model and
variant, named by :func:`result_name`; a newer run of the same thing replaces the older file)."""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time


# The vendors' HBM bandwidth by GPU name, the roofline's denominator (the first entry whose key the name
# contains): the H200's HBM3e 4.8 TB/s; the H100 SXM's HBM3 3.35 TB/s (H100 NVL 3.9, PCIe 2.0). A GH200 comes in
# two memories its name does not tell apart: assumed, like any GPU not listed.
HBM_BYTES_PER_S = (("GH200", None), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
ASSUMED_HBM_BYTES_PER_S = 4.8e12  # elsewhere (the CPU, an unknown GPU): the H200's, named as assumed


def hbm_peak(device_name: str | None = None) -> tuple[float, str]:
    """``(bytes per second, what that is the spec of)`` for this process's GPU 0 (or ``device_name``): the
    roofline every benchmark's ``*hbm_fraction`` / ``roofline_fraction`` divides by, recorded in its config."""
    import torch

    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
    peak = next((peak for key, peak in HBM_BYTES_PER_S if device_name and key in device_name), None)
    if peak is None:
        return ASSUMED_HBM_BYTES_PER_S, f"H200 (assumed; this is {device_name or 'no GPU'})"
    return peak, device_name


def hbm_peak_config() -> dict:
    """The config fields that say which roofline a result divides by (:func:`hbm_peak`)."""
    peak, of = hbm_peak()
    return {"hbm_peak_bytes_per_s": peak, "hbm_peak_of": of}


def machine_name() -> str:
    """``nvidia-h200``, ``nvidia-h100`` (``-xN`` with N GPUs), another GPU's own name, or ``cpu-Ncore``."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        name = torch.cuda.get_device_name(0)
        kind = next((kind for kind in ("H200", "H100") if kind in name and "GH200" not in name), None)
        return f"nvidia-{kind.lower()}" + (f"-x{count}" if count > 1 else "") if kind else name
    return f"cpu-{os.cpu_count()}core"


def git_commit() -> str:
    """HEAD, or ``SLIME_GIT_COMMIT`` when set: the GPU machine's copy of the repository can carry a
    stale ``.git``, so runs there pass the commit they were sent from."""
    if os.environ.get("SLIME_GIT_COMMIT"):
        return os.environ["SLIME_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def write_result(benchmark: str, config: dict, metrics: dict, out: str | None, echo: bool = True,
                 extra: dict | None = None) -> dict:
    """The results file (``echo``: printed too; a long bench writes its partial results quietly as it goes).
    ``out`` is a ``.json`` path or a folder, where the file is named by :func:`result_name`; ``extra``: more
    top-level fields beside ``metrics`` (e.g. per-step curves, which are not flat numbers)."""
    today = datetime.date.today()
    result = {"benchmark": benchmark, "date": today.isoformat(), "machine": machine_name(),
              "command": "python " + " ".join(sys.argv), "git_commit": git_commit(), "config": config, "metrics": metrics,
              **(extra or {})}
    if echo:
        print(json.dumps(result, indent=2))
    if out:
        path = out if out.endswith(".json") else os.path.join(out, result_name(benchmark, result["machine"], config) + ".json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def time_us(calls, device, repeats: int) -> float:
    """Median microseconds of one of ``calls`` (a list of closures, each on its own copy of the data it
    reads, so that together they come from HBM and not from L2): on CUDA one graph of all of them replayed
    between events, elsewhere their wall time. The first round is a warm-up (compiles, allocations)."""
    import torch

    for call in calls:
        call()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - start) / len(calls) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)

"""Shared by the benchmarks: the results file of ../shared/docs/DEVICE.md."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys


def machine_name() -> str:
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return "nvidia-h200" + (f"-x{count}" if count > 1 else "") if "H200" in torch.cuda.get_device_name(0) else torch.cuda.get_device_name(0)
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


def write_result(benchmark: str, config: dict, metrics: dict, out: str | None, echo: bool = True) -> dict:
    """The results file (``echo``: printed too; a long bench writes its partial results quietly as it goes)."""
    today = datetime.date.today()
    result = {"benchmark": benchmark, "date": today.isoformat(), "machine": machine_name(),
              "command": "python " + " ".join(sys.argv), "git_commit": git_commit(), "config": config, "metrics": metrics}
    if echo:
        print(json.dumps(result, indent=2))
    if out:
        path = out if out.endswith(".json") else os.path.join(out, f"{benchmark}-{result['machine']}-{today:%Y%m%d}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result

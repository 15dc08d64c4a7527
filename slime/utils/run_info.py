"""Where and at which commit a run happened, as results files record it (bench/ and the main command)."""

from __future__ import annotations

import os
import subprocess


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
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:
        return "unknown"

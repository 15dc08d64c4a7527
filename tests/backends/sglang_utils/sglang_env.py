"""Make SGLang's Python code importable in a CPU test subprocess.

``scripts/setup-env.sh`` installs SGLang (pinned, no kernels) and the pure-Python / CPU-wheel
modules its front end and parsers import into ``.venv/sglang-args``. One gap remains: PyPI's
torchvision is built against CUDA torch, so its C ops do not load with the CPU torch, and its
Python code then registers fake kernels for two ops that were never declared. Declaring those two
op schemas (nothing implements them; SGLang's tested paths never call them) lets the rest of
torchvision's Python code, which SGLang's model-config modules import, load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SGLANG_DIR = REPO / ".venv" / "sglang-args"
SGLANG_VERSION = "0.5.23"
STAMP = SGLANG_DIR / f".installed-{SGLANG_VERSION}-front-end"


def subprocess_env() -> dict:
    """Environment for a child process that imports SGLang (and slime, and these tests)."""
    if not STAMP.exists():
        raise RuntimeError(f"SGLang {SGLANG_VERSION}'s Python code is not installed in {SGLANG_DIR}; "
                           "run `bash scripts/setup-env.sh`")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SGLANG_DIR), str(REPO)]), TOKENIZERS_PARALLELISM="false")


def run_module(module: str, stdin: str = "", timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m module`` with SGLang importable; its output goes through files, not pipes:
    torch's shared-memory manager (started by CPU tensor payloads) outlives the child and would
    hold a pipe open."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run([sys.executable, "-m", module], input=stdin, stdout=out, stderr=err, text=True,
                              env=subprocess_env(), cwd=REPO, timeout=timeout)
        out.seek(0)
        err.seek(0)
        done.stdout, done.stderr = out.read(), err.read()
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed:\n{done.stderr[-4000:]}")
    return done


def prepare_imports() -> None:
    """Call in the child before importing anything of SGLang's."""
    import torch

    try:
        import torchvision  # noqa: F401
        return
    except RuntimeError:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    prepare_imports.library = library  # kept alive: dropping the Library object removes the definitions
    import torchvision  # noqa: F401,F811

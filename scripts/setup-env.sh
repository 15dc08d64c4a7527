#!/usr/bin/env bash
# Creates (or reuses) the virtualenv .venv at the repository root and installs slime into it.
# On a machine without an NVIDIA GPU the CPU build of PyTorch is pinned first, so that no
# multi-GB CUDA build is pulled in by a dependency.
# Usage: `bash scripts/setup-env.sh [core|dev|dev,wandb,...]` (default: dev = what the tests need).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="${1:-dev}"
python_bin="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($python_bin --version)"
  "$python_bin" -m venv .venv
fi
py=.venv/bin/python

stamp=".venv/.slime-installed"
want="$(sha1sum pyproject.toml | cut -d' ' -f1)-$extras"
# an install that covers more extras (dev) also covers the core one
if [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "$want" ] || { [ "$extras" = "core" ] && [ "${want%-core}" = "$(cut -d- -f1 "$stamp")" ]; }; }; then
  echo "[setup] .venv is up to date"
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
  # CPU machine: the CPU wheel of torch 2.13.0 (a local file on the project's machines).
  if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    echo "[setup] installing the CPU build of torch"
    "$py" -m pip install --quiet "torch==2.13.0"
  fi
fi
if [ "$extras" = "core" ]; then target="."; else target=".[$extras]"; fi
echo "[setup] installing slime ($target)"
"$py" -m pip install --quiet -e "$target"
echo "$want" > "$stamp"
echo "[setup] done: $("$py" -c 'import torch, transformers, ray; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)')"

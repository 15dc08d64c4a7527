#!/usr/bin/env bash
# Sets up .venv (if needed) and runs the whole CPU test suite. GPU tests are marked and skipped
# where CUDA is absent. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/utils -x`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup-env.sh dev
export TOKENIZERS_PARALLELISM=false
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
if [ "$#" -eq 0 ]; then
  set -- tests
fi
exec .venv/bin/python -m pytest -q -ra --timeout=900 "$@"

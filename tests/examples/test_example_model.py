"""examples/model.sh: MODEL picks the examples' model; SmolLM2's copy can take a new chat template while the
cached checkpoint that every other run reads stays as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bash(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; py={sys.executable}; source examples/model.sh; {script}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_an_unknown_model_is_refused_with_the_choices():
    result = run_bash("echo unreachable", MODEL="qwen")
    assert result.returncode == 2 and "use MODEL=tiny (the default) or MODEL=smollm2" in result.stderr
    assert "unreachable" not in result.stdout


def test_smollm2_copy_takes_the_tool_template_without_touching_the_cache(tmp_path):
    pytest.importorskip("gguf")
    from slime.utils.gguf_model import GGUFError, smollm2_hf_dir

    try:
        cached = Path(smollm2_hf_dir())
    except GGUFError as e:
        pytest.skip(str(e))
    cached_template = (cached / "chat_template.jinja").read_text() if (cached / "chat_template.jinja").exists() else None
    model = tmp_path / "model"
    result = run_bash(f'example_model {model} && $py -m examples.tool_use.template {model} --chatml', MODEL="smollm2")
    assert result.returncode == 0, result.stderr[-2000:]
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {}, "b": {}}}}}]
    copy = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    original = AutoTokenizer.from_pretrained(str(cached)).apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    assert "Tools: add(a, b)" in copy and "Tools:" not in original
    weights = next(model.glob("*.safetensors"))
    if weights.stat().st_dev == (cached / weights.name).stat().st_dev:  # one file system: linked, not copied
        assert weights.stat().st_ino == (cached / weights.name).stat().st_ino
    if cached_template is not None:
        assert (cached / "chat_template.jinja").read_text() == cached_template

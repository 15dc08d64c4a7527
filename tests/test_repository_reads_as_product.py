"""The repository speaks of the product, not of its making: no numbered work periods, issue numbers, device
"visits", commit hashes or paths outside the repository in tracked text (README, docs, comments, docstrings,
test names, bench scripts). History lives in git log; a result's date and commit live inside its JSON file."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

PATTERNS = {
    "work period": re.compile(r"\b[Ss]essions? \d+\b|(?<![\w/.-])s\d{2}[a-c]?(?![\w])"),
    "issue number": re.compile(r"\b[Ii]ssues? #?\d+"),
    "device visit": re.compile(r"\b(?:this|that|same|one|each|every|next|previous|last|device|a) visit\b", re.I),
    "commit hash": re.compile(r"(?<![\w/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])"),
    "path outside the repository": re.compile(r"\.\./shared/|(?<![\w])scratch/"),
    "dated or tagged file name": re.compile(r"[\w.]-(?:20\d{6}|s\d{2}[a-c]?|run\d)(?=[-.*{])"),
}

# Tracked paths not scanned: result files carry their date and commit by design, recorded run data is data, and
# this file's examples are the patterns themselves.
NOT_SCANNED = ("bench/results/", "tests/observability/data/", "tests/test_repository_reads_as_product.py")
# The engine's folder is being reorganised; its comments are cleaned after that move lands (remove these then).
PENDING = ("slime/backends/embedded_engine/", "tests/backends/embedded_engine/")
# (path, kind): the interface documents name the upstream commit they were read from.
ALLOWED = {("docs/INTERFACES.md", "commit hash"), ("docs/SGLANG_PROTOCOL.md", "commit hash")}
TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".ini", ".json", ".jsonl", ".html", ".js")


def findings(text: str) -> list[tuple[str, int, str]]:
    """``(kind, line, match)`` for every history mention in ``text``."""
    found = []
    for kind, pattern in PATTERNS.items():
        for match in pattern.finditer(text):
            found.append((kind, text.count("\n", 0, match.start()) + 1, match.group(0)))
    return found


def tracked_text_files() -> list[str]:
    names = subprocess.check_output(["git", "ls-files"], cwd=ROOT, text=True).splitlines()
    return [name for name in names if name.endswith(TEXT_SUFFIXES) and not name.startswith(NOT_SCANNED + PENDING)
            and (ROOT / name).is_file()]


@pytest.mark.parametrize("text,kind", [
    ("measured in session 12 on the H200", "work period"),
    ("see bench/results/engine_decode-x-s22.json", "dated or tagged file name"),
    ("bench/results/decode_step-nvidia-h200-20261201-*.json", "dated or tagged file name"),
    ("the goal of issue 54", "issue number"),
    ("timed twice in the same visit", "device visit"),
    ("at 06a4cd7 the step took", "commit hash"),
    ("wheels from ../shared/tools/device-wheels", "path outside the repository"),
])
def test_each_kind_of_history_mention_is_found(text, kind):
    assert kind in {found[0] for found in findings(text)}


@pytest.mark.parametrize("text", [
    "one aiohttp session per event loop; an MCP session per episode",
    "the routed experts a token visits",
    "rope_theta 1000000, vocab_size=151936, 0x7fffffff",
    "decode_step-nvidia-h200-qwen3-4b-w8a8_fp8-cublas-b128-p143.json at 16 / 64 / 128 rows",
])
def test_product_text_is_not_flagged(text):
    assert findings(text) == []


def test_tracked_text_reads_as_the_product():
    problems = []
    for name in tracked_text_files():
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        problems += [f"{name}:{line}: {kind}: {match!r}" for kind, line, match in findings(text)
                     if (name, kind) not in ALLOWED]
    assert not problems, "history in the product (move it to a commit message):\n" + "\n".join(problems)

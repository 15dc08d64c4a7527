"""The tool-use task: multiply two numbers with a calculator tool the model must call, then answer.

Each prompt is one user message ("Use the calculator: 47*86") with one tool, ``multiply(a, b)``.
A correct episode is two model turns: a ``<tool_call>`` with the operands copied from the question,
then the product copied from the tool's answer. The tiny model cannot multiply, so the reward
(``reward.py``) is only reachable through the tool. Files (slime's prompt format, §7.1):

* ``train.jsonl`` / ``eval.jsonl``: ``{"messages": [user], "tools": [multiply], "label": "4042"}``
  (eval problems are disjoint from train and SFT problems);
* ``sft.jsonl``: full transcripts (user, assistant tool call, tool result, assistant answer) with the
  same ``tools`` field, for the SFT warm start that teaches the call format.

    python -m examples.tool_use.task --out /tmp/tool_use_data --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

MULTIPLY_TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "a*b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [MULTIPLY_TOOL]


def question(a: int, b: int) -> str:
    return f"Use the calculator: {a}*{b}"


def transcript(a: int, b: int) -> list[dict]:
    """The conversation a perfect agent has for ``a*b`` (what the SFT warm start imitates)."""
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}]},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def _pairs(rng: random.Random, count: int, low: int, high: int, exclude: set) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    while len(pairs) < count:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in exclude:
            exclude.add(pair)
            pairs.append(pair)
    return pairs


def build(out_dir: str | Path, seed: int = 0, num_train: int = 64, num_eval: int = 32, num_sft: int = 256,
          low: int = 10, high: int = 99) -> dict[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if num_train + num_eval + num_sft > (high - low + 1) ** 2:
        raise ValueError(f"not enough distinct problems in [{low}, {high}] for {num_train}+{num_eval}+{num_sft}")
    rng, seen = random.Random(seed), set()
    splits = {name: _pairs(rng, n, low, high, seen)
              for name, n in (("eval", num_eval), ("train", num_train), ("sft", num_sft))}
    paths = {}
    for name, pairs in splits.items():
        path = out / f"{name}.jsonl"
        with open(path, "w") as f:
            for a, b in pairs:
                row = {"messages": transcript(a, b) if name == "sft" else [{"role": "user", "content": question(a, b)}],
                       "tools": TOOLS}
                if name != "sft":
                    row["label"] = str(a * b)
                f.write(json.dumps(row) + "\n")
        paths[name] = str(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=64)
    parser.add_argument("--num-eval", type=int, default=32)
    parser.add_argument("--num-sft", type=int, default=256)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.seed, args.num_train, args.num_eval, args.num_sft)))


if __name__ == "__main__":
    main()

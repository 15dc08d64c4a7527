"""The Python-tool task: products of two two-digit numbers, easy with code and hard without.

Each prompt is "What is 37*58?" with one tool, ``python(code)``, which runs the code in the sandbox
(:mod:`examples.python_tool.sandbox`) and answers with what it printed. The label is the product:
right one time in ~8000 by guessing, so a correct episode is two model turns — a ``python`` call
that prints the product, then that number as the final reply. Files (slime's prompt format):

* ``train.jsonl`` / ``eval.jsonl``: ``{"messages": [user], "tools": [python], "label": "2146"}``;
  the eval problems are distinct from the train ones;
* ``sft.jsonl``: a careless demonstrator for the warm start: on ``--sft-tool-fraction`` of its
  problems it writes ``print(a*b)`` and reports the output; on the others it answers ``GUESS``
  without running anything. The warm start so teaches both the call format and answering straight
  away, and leaves which one pays off to the reward.

    python -m examples.python_tool.task --out /tmp/python_tool_data --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

GUESS = "1000"
TOOL = {"type": "function", "function": {
    "name": "python", "description": "Runs Python code in a sandbox and returns what it printed",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
TOOLS = [TOOL]


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def tool_transcript(a: int, b: int) -> list[dict]:
    """The conversation of an agent that computes the product with the tool."""
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": f"print({a}*{b})"}}}]},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def _pairs(rng: random.Random, count: int, exclude: set) -> list[tuple[int, int]]:
    pairs = []
    while len(pairs) < count:
        pair = (rng.randrange(10, 100), rng.randrange(10, 100))
        if pair not in exclude:
            exclude.add(pair)
            pairs.append(pair)
    return pairs


def build(out_dir: str | Path, seed: int = 0, num_train: int = 256, num_eval: int = 64, num_sft: int = 2048,
          sft_tool_fraction: float = 0.3) -> dict[str, str]:
    """Write ``train.jsonl``, ``eval.jsonl`` and ``sft.jsonl`` under ``out_dir``; return their paths."""
    if not 0.0 <= sft_tool_fraction <= 1.0:
        raise ValueError(f"--sft-tool-fraction must be within [0, 1], got {sft_tool_fraction}")
    rng = random.Random(seed)
    used: set = set()
    splits = {name: [{"messages": [{"role": "user", "content": question(a, b)}], "tools": TOOLS, "label": str(a * b)}
                     for a, b in _pairs(rng, count, used)]
              for name, count in (("train", num_train), ("eval", num_eval))}
    num_tool = round(sft_tool_fraction * num_sft)
    uses_tool = [True] * num_tool + [False] * (num_sft - num_tool)
    rng.shuffle(uses_tool)
    splits["sft"] = []
    for tool in uses_tool:
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        messages = tool_transcript(a, b) if tool else [{"role": "user", "content": question(a, b)},
                                                        {"role": "assistant", "content": GUESS}]
        splits["sft"].append({"messages": messages, "tools": TOOLS})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        paths[name] = str(out / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--num-sft", type=int, default=2048)
    parser.add_argument("--sft-tool-fraction", type=float, default=0.3)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.seed, args.num_train, args.num_eval, args.num_sft, args.sft_tool_fraction)))


if __name__ == "__main__":
    main()

"""The Python-tool task: questions about a list that only the sandbox holds.

Each problem has its own list ``x`` of 2–9 digits, kept in the row's ``metadata`` and defined in the
sandbox before the model's code runs (a notebook with the data loaded: ``examples.python_tool.generate``
runs ``x = [...]`` then the snippet). The prompt never shows ``x``, so the answer cannot be worked out
or memorised — a guess is right about one time in ten — while one short call computes it. Each
question has its snippet:

=====================================  ======================  =====================
question                               code                    answer
=====================================  ======================  =====================
``x is in python. How long is x?``     ``print(len(x))``       2–9
``x is in python. What is x[-1]?``     ``print(x[-1])``        0–9
``x is in python. Sum of x mod 10?``   ``print(sum(x)%10)``    0–9
=====================================  ======================  =====================

A correct episode is two model turns: a ``python`` call with the question's snippet, then the
number it printed as the final reply. Files (slime's prompt format):

* ``train.jsonl`` / ``eval.jsonl``: ``{"messages": [user], "tools": [python], "label": "7",
  "metadata": {"x": [3, 1, 4]}}``; the eval lists are drawn apart from the train ones;
* ``sft.jsonl``: a careless demonstrator for the warm start: on ``--sft-tool-fraction`` of its
  problems it runs the question's snippet and reports the output; on the others it answers ``GUESS``
  without running anything. The warm start so teaches both the call format and answering straight
  away, and leaves which one pays off to the reward.

    python -m examples.python_tool.task --out /tmp/python_tool_data --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

GUESS = "5"
PREAMBLE = "x is in python. "
QUESTIONS = {  # question -> (the snippet that answers it, the answer computed here)
    "How long is x?": ("print(len(x))", lambda x: len(x)),
    "What is x[-1]?": ("print(x[-1])", lambda x: x[-1]),
    "Sum of x mod 10?": ("print(sum(x)%10)", lambda x: sum(x) % 10),
}
TOOL = {"type": "function", "function": {
    "name": "python", "description": "Runs Python code in a sandbox where the list x is defined; returns what it printed",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
TOOLS = [TOOL]


def prelude(x: list[int]) -> str:
    """The code the sandbox runs before the model's: the problem's data."""
    return f"x = {list(x)!r}\n"


def make_problem(rng: random.Random) -> tuple[str, list[int]]:
    question = rng.choice(sorted(QUESTIONS))
    return question, [rng.randrange(10) for _ in range(rng.randrange(2, 10))]


def answer(question: str, x: list[int]) -> str:
    return str(QUESTIONS[question][1](x))


def tool_transcript(question: str, x: list[int]) -> list[dict]:
    """The conversation of an agent that runs the question's snippet."""
    code, result = QUESTIONS[question][0], answer(question, x)
    return [
        {"role": "user", "content": PREAMBLE + question},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def build(out_dir: str | Path, seed: int = 0, num_train: int = 256, num_eval: int = 64, num_sft: int = 4096,
          sft_tool_fraction: float = 0.3) -> dict[str, str]:
    """Write ``train.jsonl``, ``eval.jsonl`` and ``sft.jsonl`` under ``out_dir``; return their paths."""
    if not 0.0 <= sft_tool_fraction <= 1.0:
        raise ValueError(f"--sft-tool-fraction must be within [0, 1], got {sft_tool_fraction}")
    rng = random.Random(seed)
    used: set = set()
    splits = {}
    for name, count in (("train", num_train), ("eval", num_eval)):
        rows = []
        while len(rows) < count:
            question, x = make_problem(rng)
            if (question, tuple(x)) in used:
                continue
            used.add((question, tuple(x)))
            rows.append({"messages": [{"role": "user", "content": PREAMBLE + question}], "tools": TOOLS,
                         "label": answer(question, x), "metadata": {"x": x}})
        splits[name] = rows
    num_tool = round(sft_tool_fraction * num_sft)
    uses_tool = [True] * num_tool + [False] * (num_sft - num_tool)
    rng.shuffle(uses_tool)
    splits["sft"] = []
    for tool in uses_tool:
        question, x = make_problem(rng)
        messages = tool_transcript(question, x) if tool else [{"role": "user", "content": PREAMBLE + question},
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
    parser.add_argument("--num-sft", type=int, default=4096)
    parser.add_argument("--sft-tool-fraction", type=float, default=0.3,
                        help="share of SFT transcripts that run the code (the others answer GUESS without running anything)")
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.seed, args.num_train, args.num_eval, args.num_sft, args.sft_tool_fraction)))


if __name__ == "__main__":
    main()

"""The tool-use task: a temperature reading the model can only give by calling the tool.

Each prompt is one user message ("What is the temperature outside?") and one tool,
``get_temperature()``, a sensor. Every problem has its own reading (a temperature from 0 to 9, drawn
at random), kept in the row's ``metadata`` where only the tool can read it, so the answer cannot be
memorised or guessed better than one time in ten: a correct episode is two model turns, a
``get_temperature`` call, then the tool's reading as the final reply. Files (slime's prompt
format, docs/INTERFACES.md §7.1):

* ``train.jsonl`` / ``eval.jsonl``: ``{"messages": [user], "tools": [get_temperature], "label": "7",
  "metadata": {"temperature": "7"}}``; the eval readings are drawn apart from the train ones;
* ``sft.jsonl``: transcripts of a careless demonstrator for the warm start: on a fraction of its
  problems (``--sft-tool-fraction``) it reads the sensor and reports the reading; on the others it
  answers without looking, always ``GUESS``. The warm start so teaches both behaviours — the call
  format and the answer without a call — and leaves which one pays off to the reward.

    python -m examples.tool_use.task --out /tmp/tool_use_data --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPERATURES = tuple(str(t) for t in range(10))
GUESS = "5"  # what the demonstrator answers when it does not look
QUESTION = "What is the temperature outside?"
TOOL = {"type": "function", "function": {
    "name": "get_temperature", "description": "Reads the outdoor thermometer",
    "parameters": {"type": "object", "properties": {}}}}
TOOLS = [TOOL]


def tool_transcript(temperature: str) -> list[dict]:
    """The conversation of an agent that reads the sensor."""
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_temperature", "arguments": {}}}]},
        {"role": "tool", "content": temperature},
        {"role": "assistant", "content": temperature},
    ]


def guess_transcript() -> list[dict]:
    """The conversation of an agent that answers without looking."""
    return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": GUESS}]


def make_problem(rng: random.Random) -> dict:
    temperature = rng.choice(TEMPERATURES)
    return {"messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS, "label": temperature,
            "metadata": {"temperature": temperature}}


def build(out_dir: str | Path, seed: int = 0, num_train: int = 256, num_eval: int = 64, num_sft: int = 4096,
          sft_tool_fraction: float = 0.3) -> dict[str, str]:
    """Write ``train.jsonl``, ``eval.jsonl`` and ``sft.jsonl`` under ``out_dir``; return their paths."""
    if not 0.0 <= sft_tool_fraction <= 1.0:
        raise ValueError(f"--sft-tool-fraction must be within [0, 1], got {sft_tool_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for offset, (name, count) in enumerate((("train", num_train), ("eval", num_eval))):
        rng = random.Random(seed * 1000 + offset)  # each split its own draws
        splits[name] = [make_problem(rng) for _ in range(count)]
    rng = random.Random(seed * 1000 + 2)
    num_tool = round(sft_tool_fraction * num_sft)
    uses_tool = [True] * num_tool + [False] * (num_sft - num_tool)
    rng.shuffle(uses_tool)
    splits["sft"] = []
    for tool in uses_tool:
        messages = tool_transcript(rng.choice(TEMPERATURES)) if tool else guess_transcript()
        splits["sft"].append({"messages": messages, "tools": TOOLS})
    paths = {}
    for name, rows in splits.items():
        path = out / f"{name}.jsonl"
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        paths[name] = str(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--num-sft", type=int, default=4096)
    parser.add_argument("--sft-tool-fraction", type=float, default=0.3,
                        help="share of SFT transcripts that look the answer up (the others answer GUESS without looking)")
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.seed, args.num_train, args.num_eval, args.num_sft, args.sft_tool_fraction)))


if __name__ == "__main__":
    main()

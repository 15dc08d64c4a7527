"""Data of the multi-agent example, from the quick start's arithmetic (``slime.utils.tiny_task``).

Writes ``train.jsonl`` (RL prompts), ``eval.jsonl`` (held-out problems) and ``sft.jsonl``: warm-start
conversations for both roles — the solver's ``12+13=`` → ``25``, and the critic's ``check 12+13=25`` →
``yes`` / ``check 12+13=24`` → ``no`` (half right answers, half off by one or two) — so the tiny model
starts with both reply formats and RL has something to sharpen.

    python -m examples.multi_agent.data --out DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from slime.utils.tiny_task import make_rows, write_jsonl
from examples.multi_agent.generate import critic_messages


def build(out_dir, seed: int = 0, max_operand: int = 10, num_train: int = 48, num_eval: int = 24,
          num_sft: int = 96) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = make_rows(num_train, seed, max_operand)
    evaluation = make_rows(num_eval, seed + 1, max_operand, exclude={r["prompt"][0]["content"] for r in train})
    rng = random.Random(seed + 2)
    sft = []
    for row in make_rows(num_sft, seed + 3, max_operand):
        question, label = row["prompt"][0]["content"], row["label"]
        sft.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": label}]})
        right = rng.random() < 0.5
        shown = label if right else str(int(label) + rng.choice([-2, -1, 1, 2]))
        sft.append({"messages": [*critic_messages(question, shown), {"role": "assistant", "content": "yes" if right else "no"}]})
    rng.shuffle(sft)
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl", "sft": out / "sft.jsonl"}
    for rows, key in ((train, "train"), (evaluation, "eval"), (sft, "sft")):
        write_jsonl(rows, paths[key])
    return {k: str(v) for k, v in paths.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    print(json.dumps(build(options.out, options.seed)))


if __name__ == "__main__":
    main()

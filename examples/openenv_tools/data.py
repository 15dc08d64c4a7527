"""Rows of the thermometer example (slime's agent-row format, ``--input-key messages --metadata-key
metadata``) and the warm-start transcripts.

* ``train.jsonl`` / ``eval.jsonl``: ``{"messages": [user], "metadata": {"split", "index", "task_id",
  "max_turns", "server": {"url", "transport", "reset_timeout"}}}`` — the question and the task id; the
  reading lives in the env;
* ``sft.jsonl``: the careless demonstrator of ``examples/tool_use`` (a share of its transcripts read the
  thermometer and report the reading, the others answer ``5`` without looking), in the same prompt and
  tool format the env offers.

    python -m examples.openenv_tools.data --out DIR --env-url http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from examples.tool_use.task import QUESTION, build as build_tool_use

MAX_TURNS = 3


def rows(split: str, count: int, server: dict) -> list[dict]:
    return [{"messages": [{"role": "user", "content": QUESTION}],
             "metadata": {"split": split, "index": i, "task_id": f"{split}-{i}", "max_turns": MAX_TURNS,
                          "server": server}} for i in range(count)]


def build(out_dir: str | Path, env_url: str, *, transport: str = "ws", num_train: int = 256, num_eval: int = 64,
          num_sft: int = 4096, sft_tool_fraction: float = 0.3, seed: int = 0) -> dict[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    server = {"url": env_url, "transport": transport, "reset_timeout": 120}
    paths = {}
    for split, count in (("train", num_train), ("eval", num_eval)):
        paths[split] = str(out / f"{split}.jsonl")
        with open(paths[split], "w") as f:
            for row in rows(split, count, server):
                f.write(json.dumps(row) + "\n")
    scratch = out / "tool_use"  # its sft.jsonl is this example's warm start; its train/eval rows are unused
    paths["sft"] = build_tool_use(scratch, seed=seed, num_train=1, num_eval=1, num_sft=num_sft,
                                  sft_tool_fraction=sft_tool_fraction)["sft"]
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--env-url", required=True)
    parser.add_argument("--transport", default="ws", choices=("ws", "http"))
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--num-sft", type=int, default=4096)
    parser.add_argument("--sft-tool-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    print(json.dumps(build(a.out, a.env_url, transport=a.transport, num_train=a.num_train, num_eval=a.num_eval,
                           num_sft=a.num_sft, sft_tool_fraction=a.sft_tool_fraction, seed=a.seed)))


if __name__ == "__main__":
    main()

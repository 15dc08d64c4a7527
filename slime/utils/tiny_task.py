"""Task data for the CPU quick start and tests: short arithmetic with a checkable answer.

Each prompt asks for ``a+b`` (operands below ``--max-operand``); the label is the decimal sum. The
reply format is the bare number, so a reward is an exact string match and a ~1M-parameter model can
learn the task on two CPU cores in minutes. Files are written in slime's prompt format (INTERFACES
§7.1): ``{"prompt": [{"role": "user", "content": "12+34="}], "label": "46"}`` as ``.jsonl`` and
``.parquet``, plus an SFT file of full conversations (``{"messages": [...]}``).

    python -m slime.utils.tiny_task --out /tmp/tiny_data --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make_problem(rng: random.Random, max_operand: int) -> tuple[str, str]:
    a, b = rng.randrange(max_operand), rng.randrange(max_operand)
    return f"{a}+{b}=", str(a + b)


def make_rows(num: int, seed: int, max_operand: int, exclude: set[str] | None = None) -> list[dict]:
    """``num`` distinct problems (not in ``exclude``), deterministic from ``seed``."""
    rng = random.Random(seed)
    exclude = set(exclude or ())
    rows, seen = [], set()
    if num > max_operand * max_operand - len(exclude):
        raise ValueError(f"cannot draw {num} distinct problems with --max-operand {max_operand}")
    while len(rows) < num:
        question, answer = make_problem(rng, max_operand)
        if question in seen or question in exclude:
            continue
        seen.add(question)
        rows.append({"prompt": [{"role": "user", "content": question}], "label": answer})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def build_task_data(out_dir: str | Path, seed: int = 0, max_operand: int = 20, num_train: int = 256,
                    num_eval: int = 64, num_sft: int = 256) -> dict[str, str]:
    """Write train/eval prompt files (jsonl + parquet) and an SFT conversation file; return their paths.

    Eval problems are disjoint from train and SFT problems, so the eval reward measures generalisation.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eval_rows = make_rows(num_eval, seed + 1, max_operand)
    held_out = {row["prompt"][0]["content"] for row in eval_rows}
    train_rows = make_rows(num_train, seed, max_operand, exclude=held_out)
    sft_rows = [
        {"messages": row["prompt"] + [{"role": "assistant", "content": row["label"]}]}
        for row in make_rows(num_sft, seed + 2, max_operand, exclude=held_out)
    ]
    paths = {}
    for name, rows in (("train", train_rows), ("eval", eval_rows), ("sft", sft_rows)):
        write_jsonl(rows, out / f"{name}.jsonl")
        write_parquet(rows, out / f"{name}.parquet")
        paths[name] = str(out / f"{name}.jsonl")
        paths[f"{name}_parquet"] = str(out / f"{name}.parquet")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--num-sft", type=int, default=256)
    args = parser.parse_args(argv)
    paths = build_task_data(args.out, args.seed, args.max_operand, args.num_train, args.num_eval, args.num_sft)
    print(json.dumps(paths))


if __name__ == "__main__":
    main()

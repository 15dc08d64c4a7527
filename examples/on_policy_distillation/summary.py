"""Scores of the on-policy distillation example.

``teacher-score``: the teacher's greedy exact-match accuracy on prompt files, asked through its
engine's ``/generate`` exactly as the student is evaluated (the chat template, temperature 0.01,
6 new tokens, ``examples.tiny_cpu.reward``'s answer extraction).

``report``: from the OPD run's ``metrics.jsonl``, the per-token reverse KL to the teacher
(``train/opd_reverse_kl``: the mean over the student's sampled tokens of log π_old − log π_teacher,
an estimate of KL(π ‖ π_teacher) per token) per step, and the student's eval accuracy per
evaluation next to the teacher's.

    python -m examples.on_policy_distillation.summary teacher-score --url http://127.0.0.1:30001 \
        --model outputs/opd/teacher --data train_prompts train.jsonl heldout eval.jsonl --json t.json
    python -m examples.on_policy_distillation.summary report --run outputs/opd/runs/opd --teacher-score t.json
"""

from __future__ import annotations

import argparse
import json
from statistics import fmean

from examples.tiny_cpu.reward import extract_answer
from slime.utils.run_summary import eval_curve, read_metrics


def teacher_score(url: str, model_dir: str, data: dict[str, str], max_new_tokens: int = 6,
                  temperature: float = 0.01) -> dict[str, float]:
    """Greedy exact-match accuracy of the model served at ``url`` on each prompt file of ``data``."""
    import requests
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scores = {}
    for name, path in data.items():
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        right = []
        for row in rows:
            text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
            answer = requests.post(f"{url}/generate", json={
                "input_ids": tokenizer.encode(text, add_special_tokens=False),
                "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens,
                                    "skip_special_tokens": False}}, timeout=60)
            answer.raise_for_status()
            right.append(extract_answer(answer.json()["text"]) == str(row["label"]).strip())
        scores[name] = fmean(right)
    return scores


def report(run_dir: str, teacher: dict[str, float] | None = None) -> dict:
    records = read_metrics(run_dir)
    kl = [(r["step"], r["train/opd_reverse_kl"]) for r in records if "train/opd_reverse_kl" in r]
    if not kl:
        raise ValueError(f"{run_dir}: no train/opd_reverse_kl records; was the run started with --use-opd?")
    evals = {name: eval_curve(records, name) for name in (teacher or {"train_prompts": 0, "heldout": 0})}
    return {"reverse_kl": kl, "eval": evals, "teacher": teacher or {}}


def _first_last_mean(values: list[float], n: int = 5) -> tuple[float, float]:
    return fmean(values[:n]), fmean(values[-n:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("teacher-score")
    score.add_argument("--url", required=True, help="the teacher engine (http://HOST:PORT)")
    score.add_argument("--model", required=True, help="the teacher's directory (its tokenizer and chat template)")
    score.add_argument("--data", nargs="+", required=True, help="name path pairs of prompt files")
    score.add_argument("--json", default=None)
    rep = sub.add_parser("report")
    rep.add_argument("--run", required=True, help="the OPD run directory (its metrics.jsonl)")
    rep.add_argument("--teacher-score", default=None, help="the JSON written by teacher-score")
    rep.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    if args.command == "teacher-score":
        if len(args.data) % 2:
            parser.error(f"--data takes name path pairs; got {len(args.data)} values")
        result = teacher_score(args.url, args.model, dict(zip(args.data[::2], args.data[1::2])))
        print("teacher greedy accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))
    else:
        teacher = None
        if args.teacher_score:
            with open(args.teacher_score) as f:
                teacher = json.load(f)
        result = report(args.run, teacher)
        kl = [v for _, v in result["reverse_kl"]]
        first, last = _first_last_mean(kl)
        print(f"per-token reverse KL to the teacher: steps 0-4 mean {first:.3f} -> last 5 steps mean {last:.3f}")
        print("  per step: " + " ".join(f"{v:.2f}" for v in kl))
        for name, curve in result["eval"].items():
            points = ", ".join(f"{step}: {value:.3f}" for step, value in curve)
            target = f" (teacher {result['teacher'][name]:.3f})" if name in result["teacher"] else ""
            print(f"student eval/{name}{target}: {points}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

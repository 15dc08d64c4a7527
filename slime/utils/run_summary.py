"""Summarise runs from their ``metrics.jsonl``: eval reward before/after, time per step by phase.

    python -m slime.utils.run_summary --sft-run runs/sft --grpo-run runs/grpo --eval-name arith
"""

from __future__ import annotations

import argparse
import json
import os
from statistics import mean


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_curve(records: list[dict], name: str) -> list[tuple[int, float]]:
    key = f"eval/{name}"
    return [(r["step"], r[key]) for r in records if r["kind"] == "eval" and key in r]


def phase_times(records: list[dict]) -> dict[str, float]:
    perf = [r for r in records if r["kind"] == "perf"]
    keys = ("perf/rollout_time", "perf/train_time", "perf/update_weights_time", "perf/step_time")
    return {k: mean(r[k] for r in perf if k in r) for k in keys if any(k in r for r in perf)}


def summarise(sft_run: str | None, grpo_run: str, eval_names: list[str]) -> dict:
    records = read_metrics(grpo_run)
    summary = {"eval": {}, "times": phase_times(records), "grpo_run": grpo_run}
    for name in eval_names:
        curve = eval_curve(records, name)
        if not curve:
            raise ValueError(f"{grpo_run}: no eval/{name} records; was --eval-interval set?")
        summary["eval"][name] = {"before": curve[0][1], "after": curve[-1][1], "curve": curve}
    train = [r["rollout/raw_reward/mean"] for r in records if r["kind"] == "rollout" and "rollout/raw_reward/mean" in r]
    if len(train) >= 10:  # means over the first and last 10 steps: single steps are noisy
        summary["train_reward_first"], summary["train_reward_last"] = mean(train[:10]), mean(train[-10:])
    if sft_run:
        sft = [r for r in read_metrics(sft_run) if r["kind"] == "train" and "train/loss" in r]
        if sft:
            summary["sft_loss_first"], summary["sft_loss_last"] = sft[0]["train/loss"], sft[-1]["train/loss"]
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-run", default=None)
    parser.add_argument("--grpo-run", required=True)
    parser.add_argument("--eval-name", nargs="+", required=True, help="eval dataset names (--eval-prompt-data)")
    args = parser.parse_args(argv)
    s = summarise(args.sft_run, args.grpo_run, args.eval_name)
    rows = []
    if "sft_loss_first" in s:
        rows.append(("SFT loss (first -> last step)", f"{s['sft_loss_first']:.3f} -> {s['sft_loss_last']:.3f}"))
    for name, e in s["eval"].items():
        start = "after SFT" if args.sft_run else "before"
        rows.append((f"eval/{name}: {start} -> after GRPO", f"{e['before']:.3f} -> {e['after']:.3f}"))
        rows.append((f"eval/{name} curve (step: reward)", ", ".join(f"{step}: {value:.2f}" for step, value in e["curve"])))
    if "train_reward_first" in s:
        rows.append(("rollout reward, mean of first -> last 10 steps", f"{s['train_reward_first']:.3f} -> {s['train_reward_last']:.3f}"))
    for key, label in (("perf/rollout_time", "rollout"), ("perf/train_time", "train"),
                       ("perf/update_weights_time", "weight update"), ("perf/step_time", "whole step")):
        if key in s["times"]:
            rows.append((f"time per step: {label}", f"{s['times'][key]:.2f} s"))
    rows.append(("metrics", os.path.join(args.grpo_run, "metrics.jsonl")))
    rows.append(("runs, logs and checkpoints", os.path.dirname(os.path.dirname(os.path.abspath(args.grpo_run)))))
    width = max(len(r[0]) for r in rows)
    print("-" * (width + 40))
    for label, value in rows:
        print(f"{label.ljust(width)}  {value}")
    print("-" * (width + 40))
    print(json.dumps({"eval": {k: {"before": v["before"], "after": v["after"]} for k, v in s["eval"].items()},
                      "times": s["times"]}))


if __name__ == "__main__":
    main()

"""Side by side: the one-step-off-policy loop (train_async.py) and the fully async rollout on one workload.

    python -m examples.fully_async.summary outputs/fully-async/runs/one_step_off outputs/fully-async/runs/fully_async

Per run: steps, wall time from the first to the last logged step, mean step time, the trainers'
share of the step spent waiting for samples, the reward of the first two and the last two steps,
and (fully async) the staleness of what was trained on and the groups dropped or requeued.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean


def summarise(run_dir: str) -> dict:
    records = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl") if line.strip()]

    def values(key):
        return [r[key] for r in records if key in r]

    rewards = values("rollout/raw_reward/mean")
    steps = values("perf/step_time")
    out = {"run": Path(run_dir).name, "steps": len(steps), "total_step_time_s": round(sum(steps), 1),
           "mean_step_time_s": round(mean(steps), 2) if steps else None,
           "mean_wait_time_ratio": round(mean(values("perf/wait_time_ratio")), 2) if steps else None,
           "reward_first_two": round(mean(rewards[:2]), 3) if rewards else None,
           "reward_last_two": round(mean(rewards[-2:]), 3) if rewards else None}
    staleness = values("rollout/fully_async/staleness_mean")
    if staleness:
        out["staleness_mean"] = round(mean(staleness), 2)
        out["staleness_max"] = max(values("rollout/fully_async/staleness_max"))
        out["dropped_stale_groups"] = sum(values("rollout/fully_async/dropped_stale_groups"))
        out["requeued_groups"] = sum(values("rollout/fully_async/requeued_groups"))
    return out


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    rows = [summarise(d) for d in argv]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])

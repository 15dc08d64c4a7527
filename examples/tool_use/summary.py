"""What the tool-use run learnt, per step, from its metrics and rollout dumps.

``run.sh`` trains with ``--save-debug-rollout-data <out>/dumps/rollout_{rollout_id}.pt``, so every
rollout step's episodes (and every evaluation's, as ``rollout_eval_<step>.pt``) are on disk. This
prints, per GRPO step, the mean reward, the share of episodes that called the tool and the mean
reward of the episodes with and without a call; the same for every greedy evaluation; then the
median step time.

    python -m examples.tool_use.summary --out outputs/tool-use [--json summary.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from statistics import fmean, median


def episodes(samples: list[dict]) -> list[dict]:
    """One record per episode (the samples of an episode share its session id and metadata)."""
    seen: dict = {}
    for s in samples:
        key = s.get("session_id") or (s.get("group_index"), s.get("index"))
        seen.setdefault(key, s)
    out = []
    for s in seen.values():
        meta = s.get("metadata") or {}
        calls = meta.get("tool_calls") or []
        out.append({
            "reward": float(s.get("reward") or 0.0),
            "removed": bool(s.get("remove_sample")),
            "tool": bool(calls),
        })
    return out


def rates(eps: list[dict]) -> dict:
    n = len(eps)
    tool = [e for e in eps if e["tool"]]
    direct = [e for e in eps if not e["tool"]]
    return {
        "episodes": n,
        "reward": fmean(e["reward"] for e in eps) if n else 0.0,
        "tool_rate": len(tool) / n if n else 0.0,
        "reward_with_tool": fmean(e["reward"] for e in tool) if tool else None,
        "reward_without_tool": fmean(e["reward"] for e in direct) if direct else None,
        "removed": sum(e["removed"] for e in eps),
    }


def load_dump(path: str) -> list[dict]:
    import torch

    return torch.load(path, weights_only=False)["samples"]


def summarise(out_dir: str) -> dict:
    dumps = os.path.join(out_dir, "dumps")
    if not os.path.isdir(dumps):
        raise FileNotFoundError(f"{dumps}: no rollout dumps (run.sh passes --save-debug-rollout-data)")
    steps, evals = {}, {}
    for path in glob.glob(os.path.join(dumps, "rollout_*.pt")):
        m = re.fullmatch(r"rollout_(eval_)?(\d+)\.pt", os.path.basename(path))
        if m:
            (evals if m.group(1) else steps)[int(m.group(2))] = rates(episodes(load_dump(path)))
    metrics_path = os.path.join(out_dir, "runs", "grpo", "metrics.jsonl")
    step_times = []
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            step_times = [r["perf/step_time"] for r in map(json.loads, filter(str.strip, f)) if "perf/step_time" in r]
    return {"steps": dict(sorted(steps.items())), "evals": dict(sorted(evals.items())),
            "median_step_time_s": median(step_times) if step_times else None,
            "total_step_time_s": sum(step_times)}


def _fmt(x) -> str:
    return "  -  " if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the OUT directory of run.sh")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    s = summarise(args.out)
    cols = "reward  tool-use  reward|tool  reward|no-tool"
    print(f"eval (greedy, held-out)  episodes  {cols}")
    for step, r in s["evals"].items():
        print(f"  before step {step:3d}       {r['episodes']:5d}     {_fmt(r['reward'])}  {_fmt(r['tool_rate'])}"
              f"     {_fmt(r['reward_with_tool'])}       {_fmt(r['reward_without_tool'])}")
    print(f"GRPO rollouts (sampled)  episodes  {cols}")
    for step, r in s["steps"].items():
        print(f"  step {step:3d}                {r['episodes']:5d}     {_fmt(r['reward'])}  {_fmt(r['tool_rate'])}"
              f"     {_fmt(r['reward_with_tool'])}       {_fmt(r['reward_without_tool'])}")
    if s["median_step_time_s"] is not None:
        print(f"GRPO step time: median {s['median_step_time_s']:.1f} s, total {s['total_step_time_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()

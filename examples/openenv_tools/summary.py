"""What the OpenEnv run learnt, per step, from its rollout dumps and metrics.

``run.sh`` trains with ``--save-debug-rollout-data <out>/dumps/rollout_{rollout_id}.pt``; this prints,
per GRPO step and per greedy evaluation, the env's mean score, the share of episodes that called
``get_temperature``, the mean score with and without a call, and how many episodes the env failed.

    python -m examples.openenv_tools.summary --out outputs/openenv-tools [--json summary.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from statistics import median

from examples.tool_use.summary import _fmt, load_dump, rates


def episodes(samples: list[dict]) -> list[dict]:
    """One record per episode (its samples share the session id and the env's summary); an episode the env
    failed counts as removed."""
    seen: dict = {}
    for s in samples:
        seen.setdefault(s.get("session_id") or (s.get("group_index"), s.get("index")), s)
    return [{"reward": float((s.get("metadata") or {}).get("openenv_reward") or 0.0),
             "tool": bool((s.get("metadata") or {}).get("openenv_tool_calls")),
             "removed": bool((s.get("metadata") or {}).get("openenv_failure"))} for s in seen.values()]


def summarise(out_dir: str) -> dict:
    dumps = os.path.join(out_dir, "dumps")
    if not os.path.isdir(dumps):
        raise FileNotFoundError(f"{dumps}: no rollout dumps (run.sh passes --save-debug-rollout-data)")
    steps, evals = {}, {}
    for path in glob.glob(os.path.join(dumps, "rollout_*.pt")):
        m = re.fullmatch(r"rollout_(eval_)?(\d+)\.pt", os.path.basename(path))
        if m:
            (evals if m.group(1) else steps)[int(m.group(2))] = rates(episodes(load_dump(path)))
    step_times = []
    metrics = os.path.join(out_dir, "runs", "grpo", "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics) as f:
            step_times = [r["perf/step_time"] for r in map(json.loads, filter(str.strip, f)) if "perf/step_time" in r]
    return {"steps": dict(sorted(steps.items())), "evals": dict(sorted(evals.items())),
            "median_step_time_s": median(step_times) if step_times else None, "total_step_time_s": sum(step_times)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the OUT directory of run.sh")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    s = summarise(args.out)
    cols = "score  tool-use  score|tool  score|no-tool  env-failed"
    for title, table in (("eval (greedy, held-out)", s["evals"]), ("GRPO rollouts (sampled)", s["steps"])):
        print(f"{title:24s} episodes  {cols}")
        for step, r in table.items():
            print(f"  step {step:3d}               {r['episodes']:5d}  {_fmt(r['reward'])}  {_fmt(r['tool_rate'])}"
                  f"     {_fmt(r['reward_with_tool'])}       {_fmt(r['reward_without_tool'])}     {r['removed']}")
    if s["median_step_time_s"] is not None:
        print(f"GRPO step time: median {s['median_step_time_s']:.1f} s, total {s['total_step_time_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()

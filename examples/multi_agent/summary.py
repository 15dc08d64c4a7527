"""Per-role scores of a multi-agent run, from its rollout dumps (``--save-debug-rollout-data``).

    python -m examples.multi_agent.summary --out outputs/multi-agent

Per GRPO step: the solver's accuracy, the critic's accuracy (verdict = truth about the solver's
answer), the share of critic replies that are a verdict at all, how often the critic says yes to a
wrong answer, and how many right answers it accepted; per evaluation: the solver's greedy accuracy.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from statistics import fmean


def load_dump(path: str) -> list[dict]:
    import torch

    return torch.load(path, weights_only=False)["samples"]


def step_scores(samples: list[dict]) -> dict:
    solver = [s for s in samples if (s.get("metadata") or {}).get("agent") == "solver"]
    critic = [s for s in samples if (s.get("metadata") or {}).get("agent") == "critic"]
    out = {"solver_acc": round(fmean(float(s["reward"]) for s in solver), 3) if solver else None}
    if critic:
        verdicts = [(s["metadata"].get("verdict", "").lower(), s["metadata"].get("solver_correct")) for s in critic]
        wrong = [v for v, correct in verdicts if not correct]
        right = [v for v, correct in verdicts if correct]
        out.update({"critic_acc": round(fmean(float(s["reward"]) for s in critic), 3),
                    "critic_verdict_rate": round(fmean(v in ("yes", "no") for v, _ in verdicts), 3),
                    "critic_yes_to_wrong": round(fmean(v == "yes" for v in wrong), 3) if wrong else None,
                    "critic_yes_to_right": f"{sum(v == 'yes' for v in right)}/{len(right)}"})
        if right and wrong:
            out["critic_balanced_acc"] = round((fmean(v == "yes" for v in right) + fmean(v == "no" for v in wrong)) / 2, 3)
    return out


def summarise(out_dir: str) -> dict:
    steps, evals = {}, {}
    for path in glob.glob(os.path.join(out_dir, "dumps", "rollout_*.pt")):
        m = re.fullmatch(r"rollout_(eval_)?(\d+)\.pt", os.path.basename(path))
        if m:
            (evals if m.group(1) else steps)[int(m.group(2))] = step_scores(load_dump(path))
    if not steps:
        raise FileNotFoundError(f"{out_dir}/dumps: no rollout dumps (run.sh passes --save-debug-rollout-data)")
    return {"steps": dict(sorted(steps.items())), "evals": dict(sorted(evals.items()))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    summary = summarise(parser.parse_args(argv).out)
    keys = ["solver_acc", "critic_acc", "critic_balanced_acc", "critic_verdict_rate", "critic_yes_to_wrong",
            "critic_yes_to_right"]
    print("| step | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for step, scores in summary["steps"].items():
        print(f"| {step} | " + " | ".join(str(scores.get(k)) for k in keys) + " |")
    print("\n| eval at step | solver greedy accuracy |\n|---|---|")
    for step, scores in summary["evals"].items():
        print(f"| {step} | {scores['solver_acc']} |")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

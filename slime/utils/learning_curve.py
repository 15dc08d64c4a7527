"""A GRPO run's learning curve from its ``metrics.jsonl``: a JSON summary (held-out accuracy before and
after, the per-step reward and accuracy curves against steps and wall-clock seconds, the step time by
phase, the model and the hardware) and a PNG of the same curves.

    python -m slime.utils.learning_curve --run outputs/real/runs/grpo --eval-name heldout \\
        --model SmolLM2-135M-Instruct --task "chain_sum" --json out.json --png out.png
    python -m slime.utils.learning_curve --compare with=a.json,b.json without=c.json,d.json --png ab.png

``--compare`` draws several runs' summaries in one figure, grouped (e.g. one flag on and off, a few seeds
each): the rollout reward and the train/rollout log-prob gap per step, held-out accuracy at each evaluation.

Wall-clock seconds count from the end of the evaluation before the first step, so the curves show the
time the loop took (evaluations during training included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from statistics import mean

from slime.utils.run_info import git_commit, machine_name
from slime.utils.run_summary import read_metrics


def hardware_name() -> str:
    """The accelerator the run used, else the CPU model and its core count."""
    import torch

    if torch.cuda.is_available():
        return f"1x {torch.cuda.get_device_name(0)}"
    model = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def learning_curve(records: list[dict], eval_name: str) -> dict:
    key = f"eval/{eval_name}"
    evals = [r for r in records if r["kind"] == "eval" and key in r]
    if not evals:
        raise ValueError(f"no {key} records: was the run given --eval-prompt-data {eval_name} FILE and --eval-interval?")
    start = evals[0]["time"] if evals[0]["step"] == 0 else min(r["time"] for r in records)
    rollouts = [r for r in records if r["kind"] == "rollout" and "rollout/raw_reward/mean" in r]
    perf = {r["step"]: r for r in records if r["kind"] == "perf" and "perf/step_time" in r}
    gap = {r["step"]: r for r in records if r["kind"] == "train" and "train/train_rollout_logprob_abs_diff" in r}
    # a step ends when its perf record is written (after training, the weight push and any evaluation)
    steps = [{"step": r["step"] + 1, "seconds": round(perf.get(r["step"], r)["time"] - start, 3),
              "reward": r["rollout/raw_reward/mean"],
              "response_length": r.get("rollout/response_len/mean"),
              **({"logprob_abs_diff": gap[r["step"]]["train/train_rollout_logprob_abs_diff"],
                  "ppo_kl": gap[r["step"]].get("train/ppo_kl")} if r["step"] in gap else {}),
              **{k[len("perf/"):]: round(v, 4) for k, v in perf.get(r["step"], {}).items()
                 if k.startswith("perf/") and k.endswith("_time")}} for r in rollouts]
    heldout = [{"step": r["step"], "seconds": round(r["time"] - start, 3), "accuracy": r[key]} for r in evals]
    split = {}
    for name in sorted({k for s in steps for k in s if k.endswith("_time")}):
        values = [s[name] for s in steps if name in s]
        split[name] = round(mean(values), 4)
    return {"before": heldout[0]["accuracy"], "after": heldout[-1]["accuracy"],
            "gain": round(heldout[-1]["accuracy"] - heldout[0]["accuracy"], 4),
            "best": max(h["accuracy"] for h in heldout), "eval_name": eval_name,
            "steps": len(steps), "seconds": steps[-1]["seconds"] if steps else 0.0,
            "step_time_split_mean_s": split, "heldout_curve": heldout, "step_curve": steps}


def _smooth(values: list[float], window: int) -> list[float]:
    return [mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, held = summary["step_curve"], summary["heldout_curve"]
    rewards = [s["reward"] for s in steps]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, x_key, label in ((axes[0], "step", "GRPO step"), (axes[1], "seconds", "wall-clock seconds")):
        xs = [s[x_key] for s in steps]
        ax.plot(xs, rewards, ".", color="tab:blue", alpha=0.35, ms=4)  # each step (a few samples: noisy)
        ax.plot(xs, _smooth(rewards, 10), color="tab:blue", lw=2, label="rollout reward (sampled, 10-step mean)")
        ax.plot([h[x_key] for h in held], [h["accuracy"] for h in held], "o-", color="tab:red", lw=2,
                label=f"held-out accuracy (greedy, {summary['eval_name']})")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward / accuracy")
    axes[0].set_ylim(0, 1)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"GRPO on {summary.get('task', 'the task')}: {summary.get('model', 'model')} on "
                 f"{summary.get('hardware', 'this machine')}\nheld-out accuracy {summary['before']:.3f} -> "
                 f"{summary['after']:.3f} in {summary['steps']} steps, {summary['seconds']:.0f} s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(groups: dict[str, list[dict]], path: str) -> None:
    """One figure of several runs' summaries by group (a colour each): per-step rollout reward (10-step
    mean), the train/rollout log-prob gap per token, and held-out accuracy at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colours = ("tab:red", "tab:blue")  # the first two groups (a flag on, off); matplotlib's cycle after them
    for index, (label, runs) in enumerate(groups.items()):
        colour = colours[index] if index < len(colours) else f"C{index}"
        for i, run in enumerate(runs):
            steps = run["step_curve"]
            name = label if i == 0 else None
            axes[0].plot([s["step"] for s in steps], _smooth([s["reward"] for s in steps], 10), color=colour,
                         alpha=0.8, label=name)
            gaps = [(s["step"], s["logprob_abs_diff"]) for s in steps if "logprob_abs_diff" in s]
            axes[1].plot([g[0] for g in gaps], [g[1] for g in gaps], color=colour, alpha=0.8, label=name)
            held = run["heldout_curve"]
            axes[2].plot([h["step"] for h in held], [h["accuracy"] for h in held], "o-", color=colour, alpha=0.8,
                         label=name)
    titles = ("rollout reward (10-step mean)", "train/rollout |log-prob difference| per token",
              "held-out accuracy (greedy)")
    for ax, title in zip(axes, titles):
        ax.set_xlabel("GRPO step")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    first = next(iter(groups.values()))[0]
    fig.suptitle(f"{first.get('model', 'model')} on {first.get('task', 'the task')}, {first.get('hardware', '')}: "
                 + ", ".join(f"{label} ({len(runs)} runs)" for label, runs in groups.items()), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="the GRPO run directory (--run-dir; holds metrics.jsonl)")
    parser.add_argument("--eval-name", help="the held-out eval dataset's name (--eval-prompt-data)")
    parser.add_argument("--model", help="the model's name, written into the JSON and the figure")
    parser.add_argument("--task", help="the task's name, written into the JSON and the figure")
    parser.add_argument("--json", help="where to write the JSON summary")
    parser.add_argument("--compare", nargs="+", metavar="LABEL=A.json,B.json",
                        help="instead: draw these summaries in one figure (--png), grouped by label")
    parser.add_argument("--png", default=None, help="where to write the learning-curve figure")
    parser.add_argument("--extra", default="{}", help="JSON object merged into the summary (config, seed, load)")
    args = parser.parse_args(argv)
    if args.compare:
        if not args.png:
            parser.error("--compare writes a figure: give --png")
        groups = {}
        for entry in args.compare:
            label, sep, files = entry.partition("=")
            if not sep or not files:
                parser.error(f"--compare {entry!r}: expected LABEL=A.json[,B.json...]")
            groups[label] = []
            for name in files.split(","):
                with open(name) as f:
                    groups[label].append(json.load(f))
        compare(groups, args.png)
        print(f"comparison: {args.png}")
        return
    missing = [flag for flag in ("run", "eval_name", "model", "task", "json") if getattr(args, flag) is None]
    if missing:
        parser.error("give --" + ", --".join(m.replace("_", "-") for m in missing) + " (or --compare)")
    curve = learning_curve(read_metrics(args.run), args.eval_name)
    summary = {"benchmark": "run_real", "date": datetime.date.today().isoformat(), "machine": machine_name(),
               "git_commit": git_commit(), "model": args.model, "task": args.task, "hardware": hardware_name(),
               **json.loads(args.extra), **curve,
               "metrics": {key: curve[key] for key in ("before", "after", "gain", "best", "steps", "seconds")}}
    summary["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    if args.png:
        plot(summary, args.png)
    print(f"held-out accuracy ({args.eval_name}, greedy): {summary['before']:.3f} -> {summary['after']:.3f} "
          f"({summary['gain']:+.3f}) in {summary['steps']} steps, {summary['seconds']:.0f} s on {summary['hardware']}")
    print(f"summary: {args.json}" + (f"\nlearning curve: {args.png}" if args.png else ""))


if __name__ == "__main__":
    main()

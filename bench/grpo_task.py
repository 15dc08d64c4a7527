"""The real-model workload of bench/e2e_grpo.py: a verifiable task, its reward on both sides, and the plot.

The task is the main command's (scripts/run-real.sh): reasoning-gym's ``chain_sum`` (two terms of one or two
digits, ``+`` or ``-``), the gym's question under the model's chat template. The model answers in prose
("The answer is 12."), so the rows use slime.rollout.reasoning_gym's ``number`` answer format (the reply's
last number), scored by the gym's verifier: 1 for the right value, else 0. SmolLM2-135M-Instruct starts at
~0.15 on it at temperature 1. slime scores with ``--rm-type reasoning_gym`` (the rows' metadata), TRL with
:func:`trl_reward`: the same :func:`slime.rollout.reasoning_gym.score`.
"""

from __future__ import annotations

import json

DATASET = "chain_sum"
CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
SLIME_REWARD_FLAGS = ["--rm-type", "reasoning_gym", "--metadata-key", "metadata"]


def build_data(out_dir: str, num_train: int, seed: int) -> dict[str, str]:
    """``train.jsonl`` of ``num_train`` gym problems (prompt / label / metadata rows, in the order both
    sides read them)."""
    from slime.rollout.reasoning_gym import build

    return build(out_dir, DATASET, config=CONFIG, num_train=num_train, num_eval=8, seed=seed, answer_format="number")


def trl_reward(prompts, completions, metadata, **kwargs) -> list[float]:
    """TRL's reward function: ``completions`` are chat messages (conversational prompts), ``metadata``
    the dataset column (JSON text)."""
    from slime.rollout.reasoning_gym import score

    return [score(c[-1]["content"] if isinstance(c, list) else c, json.loads(m)) for c, m in zip(completions, metadata)]


def plot(results: list[dict], path: str) -> None:
    """Both sides' rollout reward against step and against seconds of steps, one line per result file
    and side (``curves`` of e2e_grpo results), into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"slime": "tab:blue", "trl": "tab:orange"}
    by_side: dict[str, list[dict]] = {}
    for result in results:
        seed = result["config"].get("seed")
        for side, curve in result.get("curves", {}).items():
            by_side.setdefault(side, []).append(curve)
            label = f"{side} seed {seed}"
            by_step.plot(curve["step"], curve["reward"], color=colors.get(side), alpha=0.35, lw=1, label=label)
            by_time.plot(curve["seconds"], curve["reward"], color=colors.get(side), alpha=0.35, lw=1, label=label)
    for side, curves in by_side.items():  # the mean over seeds, step by step (as far as every seed went)
        if len(curves) < 2:
            continue
        steps = min(len(c["reward"]) for c in curves)
        reward = [sum(c["reward"][i] for c in curves) / len(curves) for i in range(steps)]
        seconds = [sum(c["seconds"][i] for c in curves) / len(curves) for i in range(steps)]
        label = f"{side}, mean of {len(curves)} seeds"
        by_step.plot(range(steps), reward, color=colors.get(side), lw=2.5, label=label)
        by_time.plot(seconds, reward, color=colors.get(side), lw=2.5, label=label)
    config = results[0]["config"]
    title = (f"{config['model']} on {results[0]['machine']}: {config['prompts']} prompts × {config['n_samples_per_prompt']} "
             f"samples × ≤{config['max_new_tokens']} tokens, {config.get('task')}")
    by_step.set(xlabel="GRPO step", ylabel="rollout reward (mean, temperature 1)", title=title)
    by_time.set(xlabel="seconds of steps (cumulative step time)", ylabel="rollout reward")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

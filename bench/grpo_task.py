"""The real-model workload of bench/e2e_grpo.py: a verifiable task, its reward on both sides, and the plot.

The task is reasoning-gym's ``chain_sum`` (two terms of one or two digits, ``+`` or ``-``), the prompt the
gym's own question under the model's chat template. The model answers in prose ("The answer is 12."), so
the answer is the reply's last number, scored by the gym's verifier (``score_answer``: 1 for the right
value, else 0). SmolLM2-135M-Instruct starts at ~0.15 on it at temperature 1 (32 samples on the CPU), in
the 10–40% band where GRPO has a signal in most groups. The same :func:`score` serves slime
(``--custom-rm-path bench.grpo_task.reward``) and TRL (:func:`trl_reward`).
"""

from __future__ import annotations

import json
import re

DATASET = "chain_sum"
CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_SPECIAL = re.compile(r"<\|[^|>]*\|>")


def build_data(out_dir: str, num_train: int, seed: int) -> dict[str, str]:
    """``train.jsonl`` of ``num_train`` gym problems (prompt / label / metadata rows, in the order both
    sides read them)."""
    from slime.rollout.reasoning_gym import build

    return build(out_dir, DATASET, config=CONFIG, num_train=num_train, num_eval=8, seed=seed, answer_format="plain")


def last_number(response: str) -> str | None:
    numbers = _NUMBER.findall(_SPECIAL.sub("", response or ""))
    return numbers[-1] if numbers else None


def score(response: str, metadata: dict | str) -> float:
    """The gym's verdict on the reply's last number."""
    from slime.rollout.reasoning_gym import _verifier

    info = (json.loads(metadata) if isinstance(metadata, str) else metadata)["reasoning_gym"]
    verify = _verifier(info["dataset"], json.dumps(info.get("config") or {}, sort_keys=True))
    return float(verify(last_number(response), info["entry"]))


async def reward(args, sample, **kwargs):
    """slime's ``--custom-rm-path bench.grpo_task.reward`` (one sample, or a list in batch mode)."""
    if isinstance(sample, list):
        return [score(s.response, s.metadata) for s in sample]
    return score(sample.response, sample.metadata)


def trl_reward(prompts, completions, metadata, **kwargs) -> list[float]:
    """TRL's reward function: ``completions`` are chat messages (conversational prompts), ``metadata``
    the dataset column (JSON text)."""
    return [score(c[-1]["content"] if isinstance(c, list) else c, m) for c, m in zip(completions, metadata)]


def plot(results: list[dict], path: str) -> None:
    """Both sides' rollout reward against step and against seconds of steps, one line per result file
    and side (``curves`` of e2e_grpo results), into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"slime": "tab:blue", "trl": "tab:orange"}
    for result in results:
        seed = result["config"].get("seed")
        for side, curve in result.get("curves", {}).items():
            label = f"{side} seed {seed}"
            by_step.plot(curve["step"], curve["reward"], color=colors.get(side), alpha=0.75, label=label)
            by_time.plot(curve["seconds"], curve["reward"], color=colors.get(side), alpha=0.75, label=label)
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

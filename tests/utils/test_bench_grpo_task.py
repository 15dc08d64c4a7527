"""bench/grpo_task.py: the real-model workload's reward reads the reply's last number and both sides score it alike."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("reasoning_gym")

from bench import grpo_task  # noqa: E402


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    paths = grpo_task.build_data(str(tmp_path_factory.mktemp("data")), num_train=6, seed=0)
    return [json.loads(line) for line in open(paths["train"])]


def test_the_last_number_of_a_prose_reply_is_scored_by_the_gyms_verifier(rows):
    row = rows[0]
    label = row["label"]
    wrong = str(int(label) + 1)
    assert grpo_task.score(f"Adding them gives {label}.<|im_end|>", row["metadata"]) == 1.0
    assert grpo_task.score(f"First {label}, but no: the answer is {wrong}.", row["metadata"]) == 0.0
    assert grpo_task.score("I cannot say.", row["metadata"]) == 0.0


def test_slime_and_trl_rewards_agree_on_the_same_replies(rows):
    replies = [f"The answer is {row['label']}." if i % 2 else "It is 1000." for i, row in enumerate(rows)]
    samples = [SimpleNamespace(response=reply, metadata=row["metadata"]) for reply, row in zip(replies, rows)]
    slime = asyncio.run(grpo_task.reward(None, samples))
    trl = grpo_task.trl_reward(prompts=[row["prompt"] for row in rows],
                               completions=[[{"role": "assistant", "content": reply}] for reply in replies],
                               metadata=[json.dumps(row["metadata"]) for row in rows])
    assert slime == trl == [float(i % 2) for i in range(len(rows))]


def test_every_shared_hyper_parameter_is_a_field_trl_keeps(tmp_path):
    """A misspelt or dropped GRPOConfig field would leave TRL on its own default (e.g. its linear decay)."""
    trl = pytest.importorskip("trl")
    from bench.e2e_grpo import trl_hyperparameters

    hyper = trl_hyperparameters(3e-6)
    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **hyper)
    assert {name: getattr(config, name) for name in hyper} == hyper

"""bench/grpo_task.py: the real-model workload scores both sides' replies alike, and TRL gets every shared hyper-parameter."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("reasoning_gym")

from bench import grpo_task  # noqa: E402
from tests.parsed_args import default_args  # noqa: E402


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    paths = grpo_task.build_data(str(tmp_path_factory.mktemp("data")), num_train=6, seed=0)
    return [json.loads(line) for line in open(paths["train"])]


def test_trl_scores_a_prose_reply_by_its_last_number_as_slimes_rm_type_does(rows):
    """TRL's reward and slime's ``--rm-type reasoning_gym`` (the rows' metadata) agree reply by reply."""
    from slime.rollout.rm_hub import async_rm

    replies = [f"First {int(row['label']) + 1}, no: the answer is {row['label']}." if i % 2 else
               f"The answer is {row['label']}, or {int(row['label']) + 1}." for i, row in enumerate(rows)]
    trl = grpo_task.trl_reward(prompts=[row["prompt"] for row in rows],
                               completions=[[{"role": "assistant", "content": reply}] for reply in replies],
                               metadata=[json.dumps(row["metadata"]) for row in rows])
    args = default_args(rm_type="reasoning_gym")
    slime = [asyncio.run(async_rm(args, SimpleNamespace(response=reply, metadata=row["metadata"], label=row["label"])))
             for reply, row in zip(replies, rows)]
    assert trl == slime == [float(i % 2) for i in range(len(rows))]


def test_every_shared_hyper_parameter_is_a_field_trl_keeps(tmp_path):
    """A misspelt or dropped GRPOConfig field would leave TRL on its own default (e.g. its linear decay)."""
    trl = pytest.importorskip("trl")
    from bench.e2e_grpo import trl_hyperparameters

    hyper = trl_hyperparameters(3e-6)
    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **hyper)
    assert {name: getattr(config, name) for name in hyper} == hyper

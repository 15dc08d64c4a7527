"""examples/coding_agent: its tasks' tests tell a fix from the original, and one slot of the generate function runs
the real Claude Code in a local sandbox against the embedded engine, the test command scoring the result."""

from __future__ import annotations

import asyncio
import json
import os
import random
from argparse import Namespace
from urllib.parse import urlparse

import pytest

from examples.coding_agent import generate as coding
from examples.coding_agent.tasks import KINDS, make_task, write_tasks
from slime.agent.harness import BaseHarness
from slime.agent.sandbox import LocalSandbox
from slime.utils.types import Sample

TEST_USER = "slime-test-coder"
needs_root = pytest.mark.skipif(not LocalSandbox().can_switch_users, reason="the CLI runs as another user: needs root")
pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("kind", range(len(KINDS)))
def test_each_task_fails_as_given_and_passes_with_its_solution(kind, tmp_path):
    task = make_task(random.Random(kind), kind)
    files, command = task["metadata"]["files"], task["metadata"]["test_command"]

    async def score(repo: dict) -> bool:
        async with LocalSandbox() as sb:  # a fresh directory each time
            os.makedirs(os.path.join(sb.root, "task"), exist_ok=True)
            await coding.write_task(sb, os.path.join(sb.root, "task"), repo, "root")
            passed, output = await coding.run_tests(sb, os.path.join(sb.root, "task"), command, "root", 60)
            return passed, output
    broken, output = asyncio.run(score(files))
    assert not broken and ("FAILED" in output or "Error" in output), output
    fixed, output = asyncio.run(score({**files, **task["metadata"]["solution"]}))
    assert fixed, output


def test_task_files_and_settings_are_checked(tmp_path):
    paths = write_tasks(str(tmp_path), count=6, seed=1, eval_count=3)
    rows = [json.loads(line) for line in open(paths["train"])]
    assert len(rows) == 6 and {row["metadata"]["split"] for row in rows} == {"train"}
    assert len({next(iter(row["metadata"]["files"])) for row in rows}) == 3  # the three kinds in turn
    args = Namespace(coding_agent={"harness": "codex", "time_budget_sec": 30})
    assert coding.settings(args, {"time_budget_sec": 90})["time_budget_sec"] == 90
    with pytest.raises(ValueError, match="unknown keys \\['budget'\\]"):
        coding.settings(Namespace(coding_agent={"budget": 3}), {})
    with pytest.raises(ValueError, match="harness 'aider'"):
        coding.settings(Namespace(coding_agent=None), {"harness": "aider"})

    async def escape():
        async with LocalSandbox(str(tmp_path / "sb")) as sb:
            await coding.write_task(sb, os.path.join(sb.root, "task"), {"../outside.py": ""}, "root")
    with pytest.raises(ValueError, match="must stay inside the task's directory"):
        asyncio.run(escape())


@needs_root
@pytest.mark.skipif(not os.environ.get("SLIME_AGENT_CC_TARBALL"),
                    reason="set SLIME_AGENT_CC_TARBALL (bash scripts/fetch-agent-clis.sh prints it)")
def test_one_slot_runs_claude_code_and_scores_the_repository(long_model_dir, long_engine, monkeypatch):
    monkeypatch.setattr(BaseHarness, "user", TEST_USER)
    monkeypatch.setenv("SLIME_AGENT_CC_EXTRA_ARGS", "--tools Bash,Edit --system-prompt 'You are a coding agent.' "
                                                    "--max-turns 2")
    engine = urlparse(long_engine.url)
    args = Namespace(hf_checkpoint=long_model_dir, sglang_router_ip=engine.hostname, sglang_router_port=engine.port,
                     sglang_tool_call_parser=None, sglang_reasoning_parser=None, apply_chat_template_kwargs=None,
                     rollout_max_context_len=8192, coding_agent={"harness": "claude_code", "time_budget_sec": 240})
    task = make_task(random.Random(0), 2)  # implement triangle(n)
    sample = Sample(index=5, group_index=2, prompt=task["prompt"], metadata=task["metadata"])
    try:
        samples = asyncio.run(coding.generate(args, sample, {"temperature": 0.0, "max_new_tokens": 16}))
    finally:
        os.system(f"userdel --remove {TEST_USER} >/dev/null 2>&1")
    assert isinstance(samples, list) and samples, samples
    first = samples[0]
    assert not first.remove_sample and first.status == Sample.Status.COMPLETED, first.metadata
    # the untrained policy cannot implement it: the tests fail, reward 0 on every sample of the session
    assert {s.reward for s in samples} == {0.0} and first.metadata["tests_passed"] is False
    assert "NotImplementedError" in first.metadata["test_output"]
    assert first.metadata["agent_exit_code"] == 1 and first.metadata["harness"] == "claude_code"
    assert len({s.rollout_id for s in samples}) == 1 and first.index == 5 and first.group_index == 2
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(long_model_dir).decode(first.tokens[: len(first.tokens) - first.response_length])
    assert "Implement triangle(n) in seq.py" in text and '"name": "Edit"' in text
    assert sum(first.loss_mask) >= 16

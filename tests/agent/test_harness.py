"""slime.agent.harness: the real Claude Code and Codex CLIs run in a local sandbox against the agent adapters.

The end-to-end tests install each CLI from its npm tarball (``scripts/fetch-agent-clis.sh`` downloads them and
prints the variables; CI sets them), run it as a separate user on a one-line task, and check what a trainer
gets: the session's sample holds the CLI's real prompt (its system prompt, tool schemas and the task) as the
chat template renders it, and the policy's own greedy answer as the trained response. The tiny model has an
8192-token context for the CLIs' prompts (Claude Code: ~2.6k tokens with one tool; Codex ~3.4k with a short
instruction file).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import tempfile
import uuid

import httpx
import pytest

from slime.agent.harness import BaseHarness, ClaudeCodeHarness, CodexHarness, HarnessContext
from slime.agent.sandbox import LocalSandbox
from slime.utils.types import Sample

TEST_USER = "slime-test-harness"
CONTEXT = 8192
GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
needs_root = pytest.mark.skipif(not LocalSandbox().can_switch_users, reason="the CLIs run as another user: needs root")
pytestmark = pytest.mark.timeout(600)


def test_harnesses_are_one_instance_per_class_and_configure_the_adapter():
    assert ClaudeCodeHarness() is ClaudeCodeHarness() and CodexHarness() is CodexHarness()
    assert ClaudeCodeHarness() is not CodexHarness() and isinstance(CodexHarness(), BaseHarness)
    ctx = HarnessContext(workdir="/work", session_id="sid-1", adapter_url="http://127.0.0.1:9", model_label="pol")
    env = ClaudeCodeHarness().settings(ctx)["env"]
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["ANTHROPIC_AUTH_TOKEN"] == "sid-1"
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "pol"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads(CodexHarness().config_toml(ctx))
    assert config["model"] == "pol" and config["model_provider"] == "slime"
    assert config["model_providers"]["slime"] == {"name": "slime", "base_url": "http://127.0.0.1:9/v1",
                                                  "env_key": "OPENAI_API_KEY", "wire_api": "responses"}


def test_a_missing_cli_tarball_or_bad_extra_env_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no claude on it
    monkeypatch.delenv("SLIME_AGENT_CC_TARBALL", raising=False)

    async def install():
        async with LocalSandbox(str(tmp_path / "sb")) as sb:
            monkeypatch.setattr(type(sb), "install_root", property(lambda self: str(tmp_path / "opt")))
            await ClaudeCodeHarness().install_cli(sb)
    with pytest.raises(RuntimeError, match="set SLIME_AGENT_CC_TARBALL to its tarball"):
        asyncio.run(install())
    monkeypatch.setenv("SLIME_AGENT_CC_TARBALL", str(tmp_path / "nothing.tgz"))
    with pytest.raises(FileNotFoundError, match="SLIME_AGENT_CC_TARBALL=.*nothing.tgz: no such file"):
        asyncio.run(install())
    monkeypatch.setenv("SLIME_AGENT_CC_EXTRA_ENVS", "[1, 2]")
    with pytest.raises(ValueError, match="SLIME_AGENT_CC_EXTRA_ENVS must be a JSON object"):
        ClaudeCodeHarness().launch_env(LocalSandbox(), "SLIME_AGENT_CC_EXTRA_ENVS")
    monkeypatch.setenv("SLIME_AGENT_CC_EXTRA_ENVS", '{"API_TIMEOUT_MS": 60000}')
    assert ClaudeCodeHarness().launch_env(LocalSandbox(), "SLIME_AGENT_CC_EXTRA_ENVS")["API_TIMEOUT_MS"] == "60000"


class FreshInstallSandbox(LocalSandbox):
    """A local sandbox whose CLIs are unpacked into its own scratch directory (nothing installed before)."""

    @property
    def install_root(self):
        return self._path("opt/slime-agent")


@pytest.mark.parametrize("harness,variable,version", [
    (ClaudeCodeHarness(), "SLIME_AGENT_CC_TARBALL", "(Claude Code)"), (CodexHarness(), "SLIME_AGENT_CODEX_TARBALL", "codex-cli")])
def test_each_cli_installs_from_its_npm_tarball_into_an_empty_sandbox(harness, variable, version, monkeypatch):
    if not os.environ.get(variable):
        pytest.skip(f"set {variable} (bash scripts/fetch-agent-clis.sh prints it)")
    monkeypatch.setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")  # a CLI on the host's PATH would be taken as it is

    async def install():
        async with FreshInstallSandbox() as sb:
            await asyncio.gather(*(harness.install_cli(sb) for _ in range(3)))  # concurrent episodes: one unpacks
            monkeypatch.setenv(variable, "/no/such/tarball.tgz")  # the next time it is found, not unpacked again
            await harness.install_cli(sb)
            command = "claude" if isinstance(harness, ClaudeCodeHarness) else "codex"
            return await sb.exec(f"{command} --version", env=harness.launch_env(sb, "UNSET_EXTRA_ENVS"), timeout=60)
    result = asyncio.run(install())
    assert result.exit_code == 0 and version in result.stdout, result


# ---------------------------------------------------------------- the real CLIs, end to end


@pytest.fixture
def agent_user(monkeypatch):
    monkeypatch.setattr(BaseHarness, "user", TEST_USER)
    yield TEST_USER
    os.system(f"userdel --remove {TEST_USER} >/dev/null 2>&1")


def run_episode(harness, adapter_cls, model_dir, engine, prompt):
    """One episode of ``harness`` through an ``adapter_cls`` adapter: ((exit code, samples, CLI log, turns the adapter
    recorded), tokenizer)."""
    from transformers import AutoTokenizer

    from slime.agent.aiohttp_threaded import run_app_in_thread

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    adapter = adapter_cls(tokenizer=tokenizer, sglang_url=engine.url)
    handle = run_app_in_thread(adapter.app)
    sid = uuid.uuid4().hex
    adapter.open_session(sid, sampling_defaults=GREEDY, max_context_tokens=CONTEXT)

    async def episode():
        async with LocalSandbox() as sb:
            workdir = os.path.join(sb.root, "repo")
            code = await harness.run(sb, workdir=workdir, session_id=sid, adapter_url=handle.url,
                                     time_budget_sec=240, prompt=prompt)
            log = await sb.read_file(await harness.log_path(sb, sid))
            turns = adapter.manager.turn_count(sid)
            samples = await adapter.finish_session(sid, base_sample=Sample(index=3, group_index=1, prompt=prompt),
                                                   reward=1.0)
            return code, samples, log, turns

    try:
        return asyncio.run(episode()), tokenizer
    finally:
        handle.stop()


def check_sample_is_the_policys_turn(sample, tokenizer, engine, *expected_in_prompt):
    prompt_ids = sample.tokens[: len(sample.tokens) - sample.response_length]
    prompt_text = tokenizer.decode(prompt_ids)
    for text in expected_in_prompt:
        assert text in prompt_text, (text, prompt_text[-2000:])
    response = sample.tokens[len(prompt_ids):]
    out = httpx.post(f"{engine.url}/generate", timeout=120, json={
        "input_ids": prompt_ids, "return_logprob": True,
        "sampling_params": {**GREEDY, "no_stop_trim": True, "skip_special_tokens": False}}).json()
    greedy = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
    # the first turn's output is the policy's own greedy answer, trained (later turns may follow in the sample)
    assert response[: len(greedy)] == greedy and sample.loss_mask[: len(greedy)] == [1] * len(greedy)
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    assert sample.reward == 1.0 and sample.index == 3 and sample.group_index == 1


@needs_root
@pytest.mark.skipif(not os.environ.get("SLIME_AGENT_CC_TARBALL"),
                    reason="set SLIME_AGENT_CC_TARBALL (bash scripts/fetch-agent-clis.sh prints it)")
def test_claude_code_runs_as_the_agent_user_and_its_turn_becomes_a_sample(long_model_dir, long_engine, agent_user,
                                                                          monkeypatch):
    from slime.agent.adapters import AnthropicAdapter

    monkeypatch.setenv("SLIME_AGENT_CC_EXTRA_ARGS", "--tools Bash --system-prompt 'You are a coding agent.' "
                                                    "--max-turns 2 --output-format json")
    (code, samples, log, turns), tokenizer = run_episode(ClaudeCodeHarness(), AnthropicAdapter, long_model_dir,
                                                          long_engine, "Write hello into greeting.txt")
    # the random policy never ends a reply within its 24 tokens: Claude Code asks it to go on, then gives up with
    # an error result (exit code 1); each of its requests is a turn the adapter recorded
    result = json.loads(log.strip().splitlines()[-1])
    assert result["type"] == "result" and code == (1 if result["is_error"] else 0), log[-3000:]
    assert result["num_turns"] == turns >= 1
    assert sum(sum(sample.loss_mask) for sample in samples) == turns * GREEDY["max_new_tokens"]
    check_sample_is_the_policys_turn(samples[0], tokenizer, long_engine, "Write hello into greeting.txt",
                                     "You are a coding agent.", '"name": "Bash"')
    home = pwd.getpwnam(agent_user).pw_dir
    assert os.stat(f"{home}/.claude/settings.json").st_uid == pwd.getpwnam(agent_user).pw_uid


@needs_root
@pytest.mark.skipif(not os.environ.get("SLIME_AGENT_CODEX_TARBALL"),
                    reason="set SLIME_AGENT_CODEX_TARBALL (bash scripts/fetch-agent-clis.sh prints it)")
def test_codex_runs_as_the_agent_user_and_its_turn_becomes_a_sample(long_model_dir, long_engine, agent_user,
                                                                    monkeypatch):
    from slime.agent.adapters import OpenAIAdapter

    shared = tempfile.mkdtemp(prefix="slime-harness-test-")  # readable by the agent user (pytest's are not)
    os.chmod(shared, 0o755)
    instructions = os.path.join(shared, "instructions.md")
    with open(instructions, "w") as f:
        f.write("You are a coding agent. Run shell commands with exec_command.")
    os.chmod(instructions, 0o644)
    monkeypatch.setenv("SLIME_AGENT_CODEX_EXTRA_ARGS", " ".join([
        f"-c model_instructions_file='\"{instructions}\"'", "-c features.multi_agent=false", "-c features.goals=false",
        "-c include_environment_context=false", "-c include_apps_instructions=false"]))
    (code, samples, log, turns), tokenizer = run_episode(CodexHarness(), OpenAIAdapter, long_model_dir, long_engine,
                                                          "Write hello into greeting.txt")
    # as under Claude Code, the policy's replies stop at their 24 tokens: the Responses API reports them
    # incomplete (max_output_tokens), which Codex answers by ending with an error
    assert code == 1 and "Incomplete response returned, reason: max_output_tokens" in log, log[-3000:]
    assert turns >= 1 and sum(sum(sample.loss_mask) for sample in samples) == turns * GREEDY["max_new_tokens"]
    check_sample_is_the_policys_turn(samples[0], tokenizer, long_engine, "Write hello into greeting.txt",
                                     "You are a coding agent. Run shell commands", "exec_command")
    shutil.rmtree(shared)

"""Coding-agent rollout: a real agent CLI solves a task in a sandbox; its model calls become the samples.

``--custom-generate-function-path examples.coding_agent.generate.generate``. Each row is a task: ``prompt`` (what
to do, the CLI's prompt) and ``metadata`` with ``files`` (``{relative path: content}``, the repository the agent
works in) and ``test_command`` (run in that directory after the agent; exit code 0 = reward 1). Per slot:

1. open an adapter session (the session id is the CLI's API key; slime's sampling parameters as its defaults,
   ``--rollout-max-context-len`` as its context budget);
2. in a fresh sandbox, write the task's files and run the harness (``slime.agent.harness``) on the prompt within
   the time budget, as the sandbox's ``agent`` user;
3. run ``test_command`` there (as the agent user) and take the reward from its exit code;
4. ``finish_session`` returns the session's samples, every one with that reward (a fan-out list sharing a
   ``rollout_id``); one sample in evaluation. An episode that breaks (sandbox, CLI install, adapter) is returned
   as one removed, aborted placeholder and logged; the run goes on.

Settings, in ``--custom-config-path`` under ``coding_agent`` (a row's ``metadata`` may override ``harness``,
``time_budget_sec`` and ``test_timeout_sec``):

    coding_agent:
      harness: claude_code          # or codex
      sandbox: local                # or e2b (then e2b_template, and adapter_host / adapter_url reachable from it)
      time_budget_sec: 600
      test_timeout_sec: 300
      adapter_host: 127.0.0.1       # a non-loopback host serves the adapter in strict mode (unguessable ids)
      adapter_url: null             # the URL the sandbox uses to reach it, when not the bound address

The CLIs come from ``SLIME_AGENT_CC_TARBALL`` / ``SLIME_AGENT_CODEX_TARBALL`` (``bash scripts/fetch-agent-clis.sh``);
docs/agents.md has the rest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

from slime.agent.harness import ClaudeCodeHarness, CodexHarness
from slime.agent.sandbox import E2BSandbox, LocalSandbox, ensure_agent_user
from slime.agent.trajectory import failed_episode
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

HARNESSES = {"claude_code": ClaudeCodeHarness, "codex": CodexHarness}
DEFAULTS = {"harness": "claude_code", "sandbox": "local", "e2b_template": None, "time_budget_sec": 600,
            "test_timeout_sec": 300, "adapter_host": "127.0.0.1", "adapter_url": None}
_adapters: dict[tuple, tuple] = {}  # (id(args), harness) -> (adapter, app handle, args): one per process and config
_adapters_lock = threading.Lock()


def settings(args, metadata: dict) -> dict:
    config = {**DEFAULTS, **(getattr(args, "coding_agent", None) or {})}
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"coding_agent in --custom-config-path: unknown keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    for key in ("harness", "time_budget_sec", "test_timeout_sec"):
        if metadata.get(key) is not None:
            config[key] = metadata[key]
    if config["harness"] not in HARNESSES:
        raise ValueError(f"coding_agent harness {config['harness']!r}: choose one of {sorted(HARNESSES)}")
    if config["sandbox"] not in ("local", "e2b"):
        raise ValueError(f"coding_agent sandbox {config['sandbox']!r}: choose local or e2b")
    return config


def agent_server(args, config: dict):
    """The process's adapter for this harness (Anthropic's API for Claude Code, OpenAI's for Codex) and the URL
    the sandbox reaches it at."""
    from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
    from slime.agent.aiohttp_threaded import run_app_in_thread

    key = (id(args), config["harness"])
    with _adapters_lock:
        entry = _adapters.get(key)
        if entry is None or entry[2] is not args:
            if config["harness"] == "claude_code":  # Anthropic's API answers with every tool_use block anyway
                adapter = AnthropicAdapter.from_args(args)
            else:  # Codex runs the parallel calls a turn makes and echoes them all
                adapter = OpenAIAdapter.from_args(args, preserve_parallel_tool_calls=True)
            entry = (adapter, run_app_in_thread(adapter.app, host=config["adapter_host"],
                                                thread_name=f"coding-agent-{config['harness']}"), args)
            _adapters[key] = entry
    return entry[0], config["adapter_url"] or entry[1].url


def sandbox_for(config: dict):
    return E2BSandbox(config["e2b_template"]) if config["sandbox"] == "e2b" else LocalSandbox()


async def write_task(sb, workdir: str, files: dict, user: str) -> None:
    for relative, content in files.items():
        if os.path.isabs(relative) or ".." in relative.split("/"):
            raise ValueError(f"task file {relative!r}: paths must stay inside the task's directory")
        await sb.write_file(f"{workdir}/{relative}", content, user=user)


async def run_tests(sb, workdir: str, command: str, user: str, timeout: float) -> tuple[bool, str]:
    result = await sb.exec(command, user=user, cwd=workdir, timeout=timeout)
    return result.exit_code == 0, (result.stdout + result.stderr)[-2000:]


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False):
    metadata = sample.metadata or {}
    config = settings(args, metadata)
    if not isinstance(metadata.get("files"), dict) or not metadata.get("test_command"):
        raise ValueError(f"coding-agent sample {sample.index}: metadata needs files ({{path: content}}) and "
                         f"test_command (load rows with --metadata-key metadata)")
    harness = HARNESSES[config["harness"]]()
    adapter, url = agent_server(args, config)
    sid = f"coding-{sample.index}-{uuid.uuid4().hex}"
    sample.session_id = sid
    adapter.open_session(sid, sampling_defaults=sampling_params,
                         max_context_tokens=getattr(args, "rollout_max_context_len", None) or 0)
    samples, started = None, time.monotonic()
    try:
        try:
            async with sandbox_for(config) as sb:
                workdir = f"{getattr(sb, 'root', None) or '/home/' + harness.user}/task"
                # the user first, so the task's files are its own (harness.run checks it again, a no-op then)
                await ensure_agent_user(sb, workdir, user=harness.user)
                await write_task(sb, workdir, metadata["files"], harness.user)
                code = await harness.run(sb, workdir=workdir, session_id=sid, adapter_url=url,
                                         time_budget_sec=float(config["time_budget_sec"]), prompt=_prompt(sample))
                passed, test_output = await run_tests(sb, workdir, metadata["test_command"], harness.user,
                                                      float(config["test_timeout_sec"]))
        except Exception as e:  # a broken episode (sandbox, install, adapter) is dropped; the run goes on
            logger.error("coding-agent episode of sample %s failed: %s: %s", sample.index, type(e).__name__, e)
            return failed_episode(sample, f"{type(e).__name__}: {e}")
        extra = {"agent_exit_code": code, "tests_passed": passed, "test_output": test_output,
                 "agent_seconds": round(time.monotonic() - started, 3), "harness": config["harness"]}
        samples = await adapter.finish_session(sid, base_sample=sample, reward=1.0 if passed else 0.0,
                                               extra_metadata=extra)
    finally:
        if samples is None:  # failed or cancelled: release the session and its in-flight turns
            await adapter.drop_session(sid, wait_timeout=0)
    if not samples:
        return failed_episode(sample, "the agent made no model call")
    return samples[0] if evaluation else samples


generate.abort_mode = "request"  # a rollout abort cancels the episode: the CLI is stopped, the session dropped


def _prompt(sample: Sample) -> str:
    if isinstance(sample.prompt, str):
        return sample.prompt
    return "\n\n".join(m.get("content") or "" for m in sample.prompt if m.get("role") == "user")

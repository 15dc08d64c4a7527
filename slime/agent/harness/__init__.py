"""Coding-agent harnesses: run a real agent CLI in a sandbox against slime's agent adapter.

A harness installs its CLI into the sandbox, writes the CLI's configuration so that every model call
goes to the adapter under the episode's session id, and runs the CLI on the task prompt as the
``agent`` user within a time budget:

    adapter = AnthropicAdapter(tokenizer=..., sglang_url=...)
    handle = run_app_in_thread(adapter.app)
    adapter.open_session(sid, sampling_defaults=sampling_params, max_context_tokens=args.rollout_max_context_len)
    async with LocalSandbox() as sb:
        exit_code = await ClaudeCodeHarness().run(sb, workdir="/work/repo", session_id=sid,
                                                  adapter_url=handle.url, time_budget_sec=600, prompt=task)
        reward = ...  # e.g. run the task's tests in sb
    samples = await adapter.finish_session(sid, base_sample=sample, reward=reward)

The adapter authenticates by session id, which the harness passes as the CLI's API key. The CLIs come
from tarballs (no network needed in the sandbox): the ``npm pack`` of a CLI's native linux-x64 build (both
CLIs now ship as native binaries), or of an older JavaScript build plus, where the sandbox has no Node.js, a
Node.js binary tarball (nodejs.org's ``node-vX-linux-x64.tar.xz``); ``scripts/fetch-agent-clis.sh`` fetches the
tested versions.
Each environment variable below names a file on this machine (uploaded into the sandbox) or an
http(s) URL (downloaded inside it). A CLI already on the sandbox's PATH is used as it is.

* ``ClaudeCodeHarness`` — Claude Code (``claude -p``) through the Anthropic adapter:
  ``SLIME_AGENT_CC_TARBALL`` (``@anthropic-ai/claude-code-linux-x64``), ``SLIME_AGENT_NODE_TARBALL``; extra command-line
  arguments in ``SLIME_AGENT_CC_EXTRA_ARGS`` (shell words), extra environment as a JSON object in
  ``SLIME_AGENT_CC_EXTRA_ENVS``.
* ``CodexHarness`` — OpenAI's Codex CLI (``codex exec``) through the OpenAI adapter, configured with a
  model provider whose ``base_url`` is the adapter's ``/v1``: ``SLIME_AGENT_CODEX_TARBALL``
  (``@openai/codex@<version>-linux-x64``), ``SLIME_AGENT_NODE_TARBALL``, ``SLIME_AGENT_CODEX_EXTRA_ARGS``,
  ``SLIME_AGENT_CODEX_EXTRA_ENVS``.

The package's modules: ``common`` (:class:`HarnessContext`, :class:`BaseHarness` and the install helpers),
``claude_code`` (:class:`ClaudeCodeHarness`) and ``codex`` (:class:`CodexHarness`).
"""

from slime.agent.harness.claude_code import ClaudeCodeHarness
from slime.agent.harness.codex import CodexHarness
from slime.agent.harness.common import NODE_TARBALL_ENV, BaseHarness, HarnessContext, install_root
# the sandbox helpers this module's namespace has always carried
from slime.agent.sandbox import AGENT_USER, INSTALL_ROOT, LocalSandbox, Sandbox, ensure_agent_user, exec_and_wait

__all__ = ["AGENT_USER", "INSTALL_ROOT", "NODE_TARBALL_ENV", "BaseHarness", "ClaudeCodeHarness", "CodexHarness",
           "HarnessContext", "LocalSandbox", "Sandbox", "ensure_agent_user", "exec_and_wait", "install_root"]

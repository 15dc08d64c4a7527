"""Claude Code (``claude -p``) through the Anthropic adapter."""

from __future__ import annotations

import json
import os
import shlex

from slime.agent.harness.common import BaseHarness, HarnessContext
from slime.agent.sandbox import Sandbox, exec_and_wait


class ClaudeCodeHarness(BaseHarness):
    """Claude Code in print mode (``claude -p``) against the Anthropic adapter.

    The adapter's coordinates go into the agent user's ``~/.claude/settings.json`` (``env``), so a
    ``claude`` started by hand in the sandbox reaches the same session; every model alias (haiku,
    sonnet, opus) names the policy. Claude Code refuses its no-permission-prompt mode as root, hence
    the agent user. Useful extra arguments: ``--tools Bash,Read,Edit`` (fewer tool schemas in every
    prompt), ``--system-prompt TEXT``, ``--max-turns N``, ``--output-format json``.
    """

    async def install_cli(self, sb: Sandbox) -> None:
        await self.install_package(sb, command="claude", tarball_env="SLIME_AGENT_CC_TARBALL",
                                   package="@anthropic-ai/claude-code")

    def settings(self, ctx: HarnessContext) -> dict:
        models = {name: ctx.model_label for name in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL",
                                                     "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                                                     "ANTHROPIC_DEFAULT_OPUS_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")}
        quiet = {name: "1" for name in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_AUTOUPDATER",
                                        "DISABLE_TELEMETRY", "DISABLE_ERROR_REPORTING")}
        return {"env": {"ANTHROPIC_BASE_URL": ctx.adapter_url, "ANTHROPIC_AUTH_TOKEN": ctx.session_id, **models, **quiet}}

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        home = await self.home(sb)
        await sb.write_file(f"{home}/.claude/settings.json", json.dumps(self.settings(ctx), indent=1), user=self.user)

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: float) -> int:
        prompt_file = await self.prompt_file(sb, ctx, prompt)
        extra = os.environ.get("SLIME_AGENT_CC_EXTRA_ARGS", "")
        cmd = (f"claude -p --dangerously-skip-permissions --model {shlex.quote(ctx.model_label)} {extra} "
               f"< {shlex.quote(prompt_file)}")
        return await exec_and_wait(sb, cmd, user=self.user, cwd=ctx.workdir, env=self.launch_env(sb, "SLIME_AGENT_CC_EXTRA_ENVS"),
                                   timeout=time_budget_sec, log_path=await self.log_path(sb, ctx.session_id))

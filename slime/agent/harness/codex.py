"""OpenAI's Codex CLI (``codex exec``) through the OpenAI adapter."""

from __future__ import annotations

import json
import os
import shlex

from slime.agent.harness.common import BaseHarness, HarnessContext
from slime.agent.sandbox import Sandbox, exec_and_wait


class CodexHarness(BaseHarness):
    """OpenAI's Codex CLI (``codex exec``) against the OpenAI adapter's Responses API.

    ``~/.codex/config.toml`` makes the adapter the model provider (``base_url`` its ``/v1``, the
    session id as ``OPENAI_API_KEY``; Codex speaks only the Responses wire API). Codex runs with its own
    sandbox and approvals off: the sandbox it runs in is the boundary. Useful extra arguments shrink its
    prompt: ``-c model_instructions_file="PATH"``, ``-c features.multi_agent=false``.
    """

    provider = "slime"

    async def install_cli(self, sb: Sandbox) -> None:
        await self.install_package(sb, command="codex", tarball_env="SLIME_AGENT_CODEX_TARBALL", package="@openai/codex")

    def config_toml(self, ctx: HarnessContext) -> str:
        return "\n".join([
            f"model = {json.dumps(ctx.model_label)}",
            f"model_provider = {json.dumps(self.provider)}",
            "check_for_update_on_startup = false",
            "",
            f"[model_providers.{self.provider}]",
            'name = "slime"',
            f"base_url = {json.dumps(ctx.adapter_url + '/v1')}",
            'env_key = "OPENAI_API_KEY"',
            'wire_api = "responses"',
            "",
        ])

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        await sb.write_file(f"{await self.home(sb)}/.codex/config.toml", self.config_toml(ctx), user=self.user)

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: float) -> int:
        prompt_file = await self.prompt_file(sb, ctx, prompt)
        extra = os.environ.get("SLIME_AGENT_CODEX_EXTRA_ARGS", "")
        cmd = (f"codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox {extra} "
               f"\"$(cat {shlex.quote(prompt_file)})\" < /dev/null")
        env = {"OPENAI_API_KEY": ctx.session_id, **self.launch_env(sb, "SLIME_AGENT_CODEX_EXTRA_ENVS")}
        return await exec_and_wait(sb, cmd, user=self.user, cwd=ctx.workdir, env=env, timeout=time_budget_sec,
                                   log_path=await self.log_path(sb, ctx.session_id))

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
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import os
import shlex
from dataclasses import dataclass

from slime.agent.sandbox import AGENT_USER, INSTALL_ROOT, LocalSandbox, Sandbox, ensure_agent_user, exec_and_wait

logger = logging.getLogger(__name__)

NODE_TARBALL_ENV = "SLIME_AGENT_NODE_TARBALL"


@dataclass(frozen=True)
class HarnessContext:
    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"


class BaseHarness(abc.ABC):
    """One instance per harness class (``ClaudeCodeHarness() is ClaudeCodeHarness()``): harnesses hold no
    per-episode state, everything an episode needs is in its ``HarnessContext``."""

    _instances: dict[type, BaseHarness] = {}
    user = AGENT_USER

    def __new__(cls, *args, **kwargs):
        if cls not in BaseHarness._instances:
            BaseHarness._instances[cls] = super().__new__(cls)
        return BaseHarness._instances[cls]

    @abc.abstractmethod
    async def install_cli(self, sb: Sandbox) -> None:
        """Make the CLI runnable in ``sb`` (idempotent)."""

    @abc.abstractmethod
    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Point the CLI at the adapter for this episode (files in the agent user's home)."""

    @abc.abstractmethod
    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: float) -> int:
        """Run the CLI on ``prompt`` in ``ctx.workdir`` as the agent user; its exit code (124: out of time)."""

    async def run(self, sb: Sandbox, *, workdir: str, session_id: str, adapter_url: str, time_budget_sec: float,
                  prompt: str, model_label: str = "slime-actor") -> int:
        """Set up and run one episode; the CLI's exit code (124: stopped at ``time_budget_sec``). Its output is
        kept in the sandbox at :meth:`log_path`."""
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url.rstrip("/"),
                             model_label=model_label)
        await ensure_agent_user(sb, workdir, user=self.user)
        await self.install_cli(sb)
        await self.write_config(sb, ctx)
        code = await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)
        logger.info("%s: session %s ended with exit code %d", type(self).__name__, session_id, code)
        return code

    # shared steps

    async def log_path(self, sb: Sandbox, session_id: str) -> str:
        """Where the CLI's stdout and stderr of the episode ``session_id`` go, in the agent user's home."""
        return f"{await self.home(sb)}/.slime-agent-{session_id}.log"

    async def prompt_file(self, sb: Sandbox, ctx: HarnessContext, prompt: str) -> str:
        path = f"{await self.home(sb)}/.slime-prompt-{ctx.session_id}.txt"
        await sb.write_file(path, prompt, user=self.user)
        return path

    async def home(self, sb: Sandbox) -> str:
        result = await sb.exec(f"getent passwd {self.user} | cut -d: -f6", timeout=30)
        home = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        if not home:  # a sandbox that cannot switch users runs everything as its own user
            home = (await sb.exec("echo $HOME", user=self.user, timeout=30)).stdout.strip()
        return home

    async def install_package(self, sb: Sandbox, *, command: str, tarball_env: str, package: str) -> str:
        """The path of ``command`` in ``sb``: found on PATH, or unpacked from the npm tarball ``$tarball_env``.

        The tarball is a package's ``npm pack``: one holding the native executable (at the package's top
        or under ``vendor/<target>/bin/``, as the platform packages of both CLIs do), else the package's
        ``bin`` entry, a JavaScript file run by Node.js.
        """
        root = install_root(sb)
        link = f"{root}/bin/{command}"
        async with _install_lock(sb, root):  # episodes sharing a filesystem unpack once, not over each other
            found = await sb.exec(f"command -v {command} || {{ test -x {link} && echo {link}; }}", timeout=30)
            if found.exit_code == 0 and found.stdout.strip():
                return found.stdout.strip().splitlines()[-1]
            return await self._unpack_package(sb, root, link, command=command, tarball_env=tarball_env, package=package)

    async def _unpack_package(self, sb: Sandbox, root: str, link: str, *, command: str, tarball_env: str,
                              package: str) -> str:
        target = f"{root}/lib/{package}"
        await _unpack(sb, _source(tarball_env, package), target, strip=1)
        native = await sb.exec(f"for f in {target}/{command} {target}/vendor/*/bin/{command}; do "
                               f"test -f $f && head -c 4 $f | grep -q ELF && echo $f && break; done",
                               timeout=30)
        entry = native.stdout.strip()
        if entry:
            script = f"#!/bin/sh\nexec {entry} \"$@\"\n"
        else:
            manifest = json.loads(await sb.read_file(f"{target}/package.json"))
            declared = manifest.get("bin")
            declared = declared.get(command) if isinstance(declared, dict) else declared
            if not declared or not declared.endswith((".js", ".cjs", ".mjs")):
                raise RuntimeError(f"{tarball_env}: no '{command}' executable in the tarball (looked for {command} and "
                                   f"vendor/*/bin/{command}; package.json's bin: {manifest.get('bin')!r}); give the "
                                   f"platform package's tarball (e.g. npm pack {package}-linux-x64)")
            node = await self.install_node(sb)
            script = f"#!/bin/sh\nexec {node} {target}/{declared} \"$@\"\n"
        await sb.write_file(link, script)
        (await sb.exec(f"chmod 755 {link} && chmod -R a+rX {root}", timeout=60)).check(f"installing {package}")
        return link

    async def install_node(self, sb: Sandbox) -> str:
        """The path of ``node`` in ``sb``, unpacked from ``$SLIME_AGENT_NODE_TARBALL`` when it has none."""
        local = f"{install_root(sb)}/node/bin/node"
        found = await sb.exec(f"command -v node || {{ test -x {local} && echo {local}; }}", timeout=30)
        if found.exit_code == 0 and found.stdout.strip():
            return found.stdout.strip().splitlines()[-1]
        await _unpack(sb, _source(NODE_TARBALL_ENV, "Node.js"), f"{install_root(sb)}/node", strip=1)
        return local

    def launch_env(self, sb: Sandbox, extra_envs_var: str) -> dict[str, str]:
        root = install_root(sb)
        env = {"PATH": f"{root}/bin:{root}/node/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        raw = os.environ.get(extra_envs_var)
        if raw:
            try:
                extra = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{extra_envs_var} must be a JSON object of environment variables: {exc}") from exc
            if not isinstance(extra, dict):
                raise ValueError(f"{extra_envs_var} must be a JSON object of environment variables, got {raw!r}")
            env.update({str(k): str(v) for k, v in extra.items()})
        return env


def install_root(sb: Sandbox) -> str:
    return getattr(sb, "install_root", None) or INSTALL_ROOT


_install_locks: dict[tuple, asyncio.Lock] = {}


def _install_lock(sb: Sandbox, root: str):
    """One installer at a time for the local sandboxes of this event loop sharing ``root`` (they share this
    machine's files); remote sandboxes have their own filesystems and need none."""
    if not isinstance(sb, LocalSandbox):
        return contextlib.nullcontext()
    key = (id(asyncio.get_running_loop()), root)
    if key not in _install_locks:
        _install_locks[key] = asyncio.Lock()
    return _install_locks[key]


def _source(env_var: str, what: str) -> str:
    value = os.environ.get(env_var)
    if not value:
        raise RuntimeError(f"{what} is not installed in the sandbox; set {env_var} to its tarball (a file on this "
                           f"machine or an http(s) URL)")
    if not value.startswith(("http://", "https://")) and not os.path.isfile(value):
        raise FileNotFoundError(f"{env_var}={value}: no such file")
    return value


async def _unpack(sb: Sandbox, source: str, target: str, *, strip: int) -> None:
    """Unpack the tarball ``source`` (a local file, uploaded, or a URL, fetched in the sandbox) into ``target``."""
    name = os.path.basename(source.split("?")[0])
    archive = f"{install_root(sb)}/downloads/{name}"
    if source.startswith(("http://", "https://")):
        fetch = f"mkdir -p {os.path.dirname(archive)} && curl -fsSL -o {shlex.quote(archive)} {shlex.quote(source)}"
        (await sb.exec(fetch, timeout=600)).check(f"downloading {source}")
    else:
        with open(source, "rb") as f:
            await sb.write_file(archive, f.read())
    unpack = f"mkdir -p {target} && tar -xf {shlex.quote(archive)} -C {target} --strip-components={strip}"
    (await sb.exec(unpack, timeout=600)).check(f"unpacking {name}")


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

"""What every coding-agent harness shares: the episode's context (:class:`HarnessContext`), the
install-configure-launch cycle (:class:`BaseHarness`) and the CLI install helpers."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import os
import shlex
from dataclasses import dataclass

from slime.agent.sandbox import AGENT_USER, INSTALL_ROOT, LocalSandbox, Sandbox, ensure_agent_user

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

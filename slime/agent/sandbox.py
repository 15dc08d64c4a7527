"""Where a coding agent runs: one interface over a local process sandbox and E2B's cloud sandboxes.

A harness (``slime.agent.harness``) installs an agent CLI into a sandbox, writes its configuration and
runs it against slime's agent adapter. The sandbox interface it needs is small:

    async with LocalSandbox() as sb:                       # or E2BSandbox(template="...")
        await sb.write_file("/work/task.txt", "fix the bug", user="agent")
        result = await sb.exec("ls /work", user="agent")  # ExecResult(exit_code, stdout, stderr)
        code = await exec_and_wait(sb, "make test", user="agent", cwd="/work", timeout=600)

``exec`` runs a command to completion (bounded by ``timeout``); ``exec_and_wait`` launches a long one
detached and polls for a done marker, so a dropped connection to a remote sandbox does not kill the
agent and a run past its budget is stopped with its whole process group (exit code 124).

``LocalSandbox`` runs commands as processes on this machine: a fresh scratch directory for relative
paths, users switched with ``runuser`` when slime runs as root (otherwise every user is the current
one, with its home inside the scratch directory). It isolates nothing else — files elsewhere, the network and the processes of the machine are
the agent's to touch — so use it for trusted agents, tests and development; run untrusted policies
in a container or in ``E2BSandbox``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import shlex
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

AGENT_USER = "agent"
INSTALL_ROOT = "/opt/slime-agent"  # where harnesses unpack CLIs in a sandbox (a sandbox may name its own: install_root)
TIMEOUT_EXIT_CODE = 124  # what coreutils' timeout returns; exec_and_wait's code for a run past its budget


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str

    def check(self, what: str) -> ExecResult:
        """Self, or a RuntimeError naming ``what`` failed with its exit code and output."""
        if self.exit_code != 0:
            raise RuntimeError(f"sandbox: {what} failed with exit code {self.exit_code}: "
                               f"{(self.stderr or self.stdout).strip()[-2000:]}")
        return self


@runtime_checkable
class Sandbox(Protocol):
    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, *exc_info) -> None: ...

    async def exec(self, cmd: str, *, user: str = "root", cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout: float | None = 60.0) -> ExecResult:
        """Run the shell command ``cmd`` to completion; past ``timeout`` seconds it is killed (exit code 124)."""

    async def write_file(self, path: str, content: str | bytes, *, user: str = "root") -> None:
        """Write ``content`` at ``path`` (parents created), owned by ``user``."""

    async def read_file(self, path: str, *, user: str = "root") -> str:
        """The text at ``path``, read as ``user``."""


async def ensure_agent_user(sb: Sandbox, workdir: str, *, user: str = AGENT_USER) -> str:
    """Create ``user`` (a login with a home) unless it exists, give it ``workdir``; return its home directory.

    Agent CLIs refuse their no-permission-prompt modes as root, and a separate user keeps the agent
    out of the harness's installation.
    """
    if isinstance(sb, LocalSandbox) and not sb.can_switch_users:
        await sb.exec(f"mkdir -p {shlex.quote(workdir)}", timeout=30)
        return sb.home(user)
    # concurrent episodes may race to create the user (useradd: "already exists", or /etc/passwd locked): retry
    script = (f"for attempt in $(seq 50); do id -u {user} >/dev/null 2>&1 && break; "
              f"useradd --create-home --shell /bin/bash {user} 2>/dev/null && break; sleep 0.1; done\n"
              f"mkdir -p {shlex.quote(workdir)} && chown -R {user}: {shlex.quote(workdir)}\n"
              f"getent passwd {user} | cut -d: -f6")
    result = (await sb.exec(script, timeout=60)).check(f"creating the user {user!r} and {workdir}")
    return result.stdout.strip().splitlines()[-1]


async def exec_and_wait(sb: Sandbox, cmd: str, *, user: str = "root", cwd: str | None = None,
                        env: dict[str, str] | None = None, timeout: float, poll_interval: float = 1.0,
                        log_path: str | None = None) -> int:
    """Launch ``cmd`` detached (its own session), poll for its done marker, return its exit code.

    Past ``timeout`` seconds the command's process group is sent SIGTERM, then SIGKILL two seconds
    later, and the result is 124; a cancelled wait stops it the same way and lets CancelledError through.
    Its stdout and stderr go to ``log_path`` (default: a file under /tmp named in the log).
    """
    token = uuid.uuid4().hex[:12]
    marker = f"/tmp/slime-exec-{token}.done"
    log_path = log_path or f"/tmp/slime-exec-{token}.log"
    # the command in its own shell (an `exit` in it ends that one), the marker written whole once it returns
    body = f"bash -c {shlex.quote(cmd)}; echo $? > {marker}.part && mv {marker}.part {marker}"
    launch = (f"setsid nohup bash -c {shlex.quote(body)} > {shlex.quote(log_path)} 2>&1 < /dev/null & "
              f"echo $!")
    started = await sb.exec(launch, user=user, cwd=cwd, env=env, timeout=60)
    pid = int(started.check(f"launching {cmd[:80]!r}").stdout.split()[-1])
    logger.info("sandbox: %r launched as %s (pid %d, output in %s)", cmd[:80], user, pid, log_path)
    deadline = time.monotonic() + timeout
    stop = f"kill -TERM -- -{pid} 2>/dev/null; sleep 2; kill -KILL -- -{pid} 2>/dev/null; true"
    try:
        while True:
            done = await sb.exec(f"cat {marker} 2>/dev/null && rm -f {marker}", user=user, timeout=60)
            if done.exit_code == 0 and done.stdout.strip():
                return int(done.stdout.strip())
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))
    except asyncio.CancelledError:  # the episode was cancelled (a rollout abort): the command must not outlive it
        logger.info("sandbox: %r cancelled; stopping its process group %d", cmd[:80], pid)
        await asyncio.shield(sb.exec(stop, user=user, timeout=30))
        raise
    logger.warning("sandbox: %r ran past its %g s budget; stopping its process group %d", cmd[:80], timeout, pid)
    await sb.exec(stop, user=user, timeout=30)
    return TIMEOUT_EXIT_CODE


class LocalSandbox:
    """Processes on this machine (see the module docstring for what it does not isolate).

    ``root`` is the scratch directory relative paths and ``cwd=None`` resolve to (a fresh temporary
    directory by default, removed on exit unless ``keep=True``).
    """

    def __init__(self, root: str | None = None, *, keep: bool = False):
        self._root_arg, self.keep = root, keep
        self.root: str | None = None
        self.runuser = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin")
        self.can_switch_users = os.geteuid() == 0 and self.runuser is not None

    async def __aenter__(self) -> LocalSandbox:
        self.root = self._root_arg or tempfile.mkdtemp(prefix="slime-sandbox-")
        os.makedirs(self.root, exist_ok=True)
        if self.can_switch_users and not self._root_arg:
            os.chmod(self.root, 0o711)  # other users reach what they own inside (a workdir) but list nothing
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self.root and not self.keep and not self._root_arg:
            shutil.rmtree(self.root, ignore_errors=True)

    def _path(self, path: str) -> str:
        if self.root is None:
            raise RuntimeError("LocalSandbox: use it as `async with LocalSandbox() as sb:`")
        return path if os.path.isabs(path) else os.path.join(self.root, path)

    def _account(self, user: str) -> pwd.struct_passwd | None:
        if not self.can_switch_users:
            return None
        try:
            return pwd.getpwnam(user)
        except KeyError:
            raise ValueError(f"LocalSandbox: no user {user!r} on this machine (ensure_agent_user creates one)") from None

    @property
    def install_root(self) -> str:
        """Where harnesses unpack their CLIs, kept between episodes: /opt/slime-agent as root, else
        ~/.cache/slime/agent-install (``$SLIME_AGENT_INSTALL_ROOT`` overrides both)."""
        override = os.environ.get("SLIME_AGENT_INSTALL_ROOT")
        if override:
            return override
        return INSTALL_ROOT if self.can_switch_users else os.path.expanduser("~/.cache/slime/agent-install")

    def home(self, user: str) -> str:
        """The user's home; without user switching, ``<root>/home/<user>``, so that an agent's configuration
        files never overwrite the invoking user's own."""
        account = self._account(user)
        if account:
            return account.pw_dir
        home = self._path(os.path.join("home", user))
        os.makedirs(home, exist_ok=True)
        return home

    async def exec(self, cmd: str, *, user: str = "root", cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout: float | None = 60.0) -> ExecResult:
        account = self._account(user)
        base = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8",
                "HOME": self.home(user), "USER": account.pw_name if account else pwd.getpwuid(os.geteuid()).pw_name}
        argv = ["bash", "-c", cmd]
        if account and account.pw_uid != os.geteuid():
            argv = [self.runuser, "-u", user, "--", *argv]
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self._path(cwd or "."), env={**base, **(env or {})}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            stdout, stderr = await proc.communicate()
            return ExecResult(TIMEOUT_EXIT_CODE, stdout.decode(errors="replace"),
                              stderr.decode(errors="replace") + f"\n(killed after {timeout:g} s)")
        except asyncio.CancelledError:
            _kill_group(proc.pid)
            raise
        return ExecResult(proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"))

    async def write_file(self, path: str, content: str | bytes, *, user: str = "root") -> None:
        path, account = self._path(path), self._account(user)
        created = _missing_parents(os.path.dirname(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        if account:
            for item in [*created, path]:
                os.chown(item, account.pw_uid, account.pw_gid)

    async def read_file(self, path: str, *, user: str = "root") -> str:
        account = self._account(user)
        if account and account.pw_uid != os.geteuid():  # read with the user's permissions
            result = await self.exec(f"cat {shlex.quote(self._path(path))}", user=user)
            return result.check(f"reading {path} as {user}").stdout
        with open(self._path(path), encoding="utf-8", errors="replace") as f:
            return f.read()


def _missing_parents(directory: str) -> list[str]:
    missing = []
    while directory and not os.path.exists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    return missing[::-1]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class E2BSandbox:
    """A cloud sandbox of E2B (https://e2b.dev) through its ``e2b`` SDK; needs ``E2B_API_KEY``.

    ``template`` names the sandbox image (E2B's base image by default); ``lifetime`` is how long E2B
    keeps it alive (seconds); other keyword arguments go to ``AsyncSandbox.create``.
    """

    def __init__(self, template: str | None = None, *, lifetime: float = 3600, **create_kwargs):
        self.template, self.lifetime, self.create_kwargs = template, lifetime, create_kwargs
        self._sandbox = None

    async def __aenter__(self) -> E2BSandbox:
        try:
            from e2b import AsyncSandbox
        except ImportError as exc:
            raise ImportError("E2BSandbox needs the e2b SDK: pip install e2b") from exc
        kwargs = dict(self.create_kwargs, timeout=int(self.lifetime))
        if self.template:
            kwargs["template"] = self.template
        self._sandbox = await AsyncSandbox.create(**kwargs)
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._sandbox is not None:
            await self._sandbox.kill()
            self._sandbox = None

    @property
    def sandbox(self):
        if self._sandbox is None:
            raise RuntimeError("E2BSandbox: use it as `async with E2BSandbox(...) as sb:`")
        return self._sandbox

    async def exec(self, cmd: str, *, user: str = "root", cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout: float | None = 60.0) -> ExecResult:
        from e2b import CommandExitException, TimeoutException

        try:
            result = await self.sandbox.commands.run(cmd, user=user, cwd=cwd, envs=env or {}, timeout=timeout or 0)
        except CommandExitException as exc:  # a non-zero exit: the SDK raises with the result's fields
            return ExecResult(exc.exit_code, exc.stdout, exc.stderr)
        except TimeoutException as exc:
            return ExecResult(TIMEOUT_EXIT_CODE, "", f"{exc} (killed after {timeout:g} s)")
        return ExecResult(result.exit_code, result.stdout, result.stderr)

    async def write_file(self, path: str, content: str | bytes, *, user: str = "root") -> None:
        await self.sandbox.files.write(path, content, user=user)

    async def read_file(self, path: str, *, user: str = "root") -> str:
        return await self.sandbox.files.read(path, user=user)

"""slime.agent.sandbox.E2BSandbox against the e2b SDK's own interface.

E2B's cloud is not reachable from the test machines, so ``e2b.AsyncSandbox`` is replaced by a stand-in that
runs commands on this machine but takes every call through the real SDK methods' signatures
(``inspect.signature(...).bind``: a misspelt or missing argument fails here as it would there) and answers with
the SDK's own types: ``CommandResult``, ``CommandExitException`` for a non-zero exit, ``TimeoutException``
past the timeout. What is checked is slime's side of the contract — the exit codes, outputs, timeouts and
files the harness relies on, through ``exec_and_wait`` and ``ensure_agent_user``'s calls.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess

import pytest

e2b = pytest.importorskip("e2b")
from e2b.sandbox_async.commands.command import Commands  # noqa: E402
from e2b.sandbox_async.filesystem.filesystem import Filesystem  # noqa: E402

from slime.agent.sandbox import TIMEOUT_EXIT_CODE, E2BSandbox, exec_and_wait  # noqa: E402


class StandInCommands:
    def __init__(self, root):
        self.root, self.calls = root, []

    async def run(self, *args, **kwargs):
        bound = inspect.signature(Commands.run).bind(self, *args, **kwargs)  # the SDK's own parameters
        bound.apply_defaults()
        call = bound.arguments
        self.calls.append(call)
        try:
            done = await asyncio.to_thread(
                subprocess.run, ["/bin/bash", "-l", "-c", call["cmd"]], cwd=call["cwd"] or self.root,
                env={**os.environ, **(call["envs"] or {})}, capture_output=True, text=True,
                timeout=call["timeout"] or None)
        except subprocess.TimeoutExpired:
            raise e2b.TimeoutException("context deadline exceeded") from None
        result = dict(stdout=done.stdout, stderr=done.stderr, exit_code=done.returncode, error=None)
        if done.returncode != 0:
            raise e2b.CommandExitException(**result)
        return e2b.CommandResult(**result)


class StandInFiles:
    def __init__(self, root):
        self.root = root

    def _path(self, path):
        return path if os.path.isabs(path) else os.path.join(self.root, path)

    async def write(self, *args, **kwargs):
        call = inspect.signature(Filesystem.write).bind(self, *args, **kwargs).arguments
        path = self._path(call["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = call["data"]
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)

    async def read(self, *args, **kwargs):
        call = inspect.signature(Filesystem.read).bind(self, *args, **kwargs).arguments
        with open(self._path(call["path"])) as f:
            return f.read()


class StandInSandbox:
    created = []

    def __init__(self, root):
        self.commands, self.files, self.killed = StandInCommands(root), StandInFiles(root), False

    @classmethod
    async def create(cls, *args, **kwargs):
        inspect.signature(e2b.AsyncSandbox.create).bind(*args, **kwargs)
        sandbox = cls(kwargs.pop("root_for_test"))
        cls.created.append((kwargs, sandbox))
        return sandbox

    async def kill(self, *args, **kwargs):
        self.killed = True
        return True


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(e2b, "AsyncSandbox", StandInSandbox)
    StandInSandbox.created.clear()
    return StandInSandbox


def test_e2b_sandbox_runs_commands_files_and_detached_launches_through_the_sdk(stand_in, tmp_path):
    async def main():
        async with E2BSandbox("my-template", lifetime=900, root_for_test=str(tmp_path)) as sb:
            ok = await sb.exec("echo $GREETING; pwd", env={"GREETING": "hi"}, cwd=str(tmp_path))
            assert (ok.exit_code, ok.stdout) == (0, f"hi\n{tmp_path}\n")
            failed = await sb.exec("echo partial; echo bad >&2; exit 3")
            assert (failed.exit_code, failed.stdout, failed.stderr) == (3, "partial\n", "bad\n")
            slow = await sb.exec("sleep 5", timeout=0.5)
            assert slow.exit_code == TIMEOUT_EXIT_CODE and "killed after 0.5 s" in slow.stderr
            await sb.write_file("notes/a.txt", "hello", user="agent")
            assert await sb.read_file("notes/a.txt", user="agent") == "hello"
            code = await exec_and_wait(sb, "echo done > out.txt; exit 5", cwd=str(tmp_path), timeout=30,
                                       poll_interval=0.1, log_path=str(tmp_path / "run.log"))
            assert code == 5 and (tmp_path / "out.txt").read_text() == "done\n"
            assert await exec_and_wait(sb, "sleep 30", timeout=1, poll_interval=0.2) == TIMEOUT_EXIT_CODE
            return sb.sandbox
    sandbox = asyncio.run(main())
    [(kwargs, created)] = stand_in.created
    assert created is sandbox and sandbox.killed
    assert kwargs == {"template": "my-template", "timeout": 900}
    # every command went as the SDK's user and with a timeout it honours (0 = none)
    assert {call["user"] for call in sandbox.commands.calls} == {"root"}
    assert all(call["timeout"] is not None for call in sandbox.commands.calls)


def test_e2b_sandbox_outside_its_context_is_named():
    with pytest.raises(RuntimeError, match="use it as `async with E2BSandbox"):
        asyncio.run(E2BSandbox().exec("true"))

"""slime.agent.sandbox: the local process sandbox, the agent user and the detached launch with its done marker."""

import asyncio
import os
import random
import pwd
import time

import pytest

from slime.agent.sandbox import (TIMEOUT_EXIT_CODE, ExecResult, LocalSandbox, Sandbox, ensure_agent_user,
                                 exec_and_wait)

needs_root = pytest.mark.skipif(not LocalSandbox().can_switch_users, reason="switching users needs root and runuser")
TEST_USER = "slime-test-agent"


def run(coro):
    return asyncio.run(coro)


def unique_sleep() -> tuple[str, str]:
    """A ``sleep`` command no other process on the machine runs (a concurrent test run's neither) and the
    ``pgrep -x``-free pattern that finds only the sleep itself (its bracket keeps the pgrep out)."""
    seconds = f"{random.randint(40, 90)}.{random.randint(0, 10**6):06d}"
    return f"sleep {seconds}", f"slee[p] {seconds}"


def test_exec_runs_in_the_scratch_directory_with_the_given_environment_and_cleans_up():
    async def main():
        async with LocalSandbox() as sb:
            assert isinstance(sb, Sandbox)
            await sb.write_file("notes/a.txt", "hello\n")
            result = await sb.exec("cat notes/a.txt; echo $GREETING; pwd; exit 3", env={"GREETING": "hi"})
            assert result == ExecResult(3, f"hello\nhi\n{sb.root}\n", "")
            failing = await sb.exec("ls /no/such/dir")
            with pytest.raises(RuntimeError, match="listing failed with exit code 2: .*no/such/dir"):
                failing.check("listing")
            assert await sb.read_file("notes/a.txt") == "hello\n"
            return sb.root
    root = run(main())
    assert not os.path.exists(root)


def test_exec_past_its_timeout_is_killed_with_its_children():
    async def main():
        async with LocalSandbox() as sb:
            started = time.monotonic()
            sleep, pattern = unique_sleep()
            result = await sb.exec(f"({sleep}; touch late) & {sleep}", timeout=0.5)
            assert result.exit_code == TIMEOUT_EXIT_CODE and "killed after 0.5 s" in result.stderr
            assert time.monotonic() - started < 5
            await asyncio.sleep(0.3)
            assert not os.path.exists(os.path.join(sb.root, "late"))
            return (await sb.exec(f"pgrep -f '{pattern}' || true")).stdout.strip()
    assert run(main()) == ""


def test_exec_and_wait_returns_the_exit_code_and_stops_a_run_past_its_budget(tmp_path):
    async def main():
        async with LocalSandbox() as sb:
            log = str(tmp_path / "out.log")
            code = await exec_and_wait(sb, "echo working; sleep 0.5; exit 7", timeout=30, poll_interval=0.1,
                                       log_path=log)
            assert code == 7 and open(log).read() == "working\n"
            started = time.monotonic()
            sleep, pattern = unique_sleep()
            code = await exec_and_wait(sb, f"trap '' TERM; {sleep} & {sleep}; touch finished", timeout=1,
                                       poll_interval=0.2)
            assert code == TIMEOUT_EXIT_CODE and time.monotonic() - started < 10
            assert not os.path.exists(os.path.join(sb.root, "finished"))
            assert (await sb.exec(f"pgrep -f '{pattern}' || true")).stdout.strip() == ""
    run(main())


def test_a_cancelled_wait_stops_the_command():
    async def main():
        async with LocalSandbox() as sb:
            sleep, pattern = unique_sleep()
            task = asyncio.create_task(exec_and_wait(sb, f"{sleep} & {sleep}; touch finished", timeout=120,
                                                     poll_interval=0.1))
            await asyncio.sleep(1.0)
            assert (await sb.exec(f"pgrep -f '{pattern}'")).stdout.strip() != ""
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return (await sb.exec(f"pgrep -f '{pattern}' || true")).stdout.strip()
    assert run(main()) == ""


@pytest.fixture
def test_user():
    yield TEST_USER
    if LocalSandbox().can_switch_users:
        os.system(f"userdel --remove {TEST_USER} >/dev/null 2>&1")


@needs_root
def test_the_agent_user_owns_its_workdir_and_files_and_cannot_touch_roots(test_user):
    async def main():
        async with LocalSandbox() as sb:
            workdir = os.path.join(sb.root, "repo")
            home = await ensure_agent_user(sb, workdir, user=test_user)
            assert home == pwd.getpwnam(test_user).pw_dir and os.path.isdir(home)
            assert await ensure_agent_user(sb, workdir, user=test_user) == home  # idempotent
            os.chmod(sb.root, 0o755)
            await sb.write_file(f"{home}/.config/tool/settings.json", "{}", user=test_user)
            uid = pwd.getpwnam(test_user).pw_uid
            assert os.stat(f"{home}/.config/tool/settings.json").st_uid == uid
            assert os.stat(f"{home}/.config").st_uid == uid
            assert os.stat(workdir).st_uid == uid
            result = await sb.exec("whoami; echo $HOME; touch mine && echo ok", user=test_user, cwd=workdir)
            assert result.stdout.split() == [test_user, home, "ok"]
            await sb.write_file("secret.txt", "root only")
            os.chmod(os.path.join(sb.root, "secret.txt"), 0o600)
            denied = await sb.exec(f"cat {sb.root}/secret.txt", user=test_user)
            assert denied.exit_code != 0 and "Permission denied" in denied.stderr
            with pytest.raises(RuntimeError, match="Permission denied"):
                await sb.read_file("secret.txt", user=test_user)
            assert await sb.read_file("secret.txt") == "root only"
            code = await exec_and_wait(sb, "id -un > who.txt", user=test_user, cwd=workdir, timeout=30,
                                       poll_interval=0.1)
            assert code == 0 and open(os.path.join(workdir, "who.txt")).read().strip() == test_user
    run(main())


@needs_root
def test_concurrent_episodes_create_the_agent_user_once(test_user):
    async def main():
        async with LocalSandbox() as sb:
            return await asyncio.gather(*(ensure_agent_user(sb, os.path.join(sb.root, f"w{i}"), user=test_user)
                                          for i in range(6)))
    homes = run(main())
    assert set(homes) == {pwd.getpwnam(test_user).pw_dir}


@needs_root
def test_an_unknown_user_is_named():
    async def main():
        async with LocalSandbox() as sb:
            with pytest.raises(ValueError, match="no user 'nobody-here'"):
                await sb.exec("true", user="nobody-here")
    run(main())

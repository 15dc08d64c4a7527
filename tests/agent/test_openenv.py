"""slime.agent.openenv against real OpenEnv servers (openenv-core's own server code, on loopback).

The env (``openenv_envs.CalculatorEnv``): tasks ``add-A-B`` with an ``add`` tool and a verifier behind
``end_turn``; ``crash-*`` tasks whose ``end_turn`` raises mid-episode. The model is the tiny model
taught ``agent_script.py`` (greedy: "What is 3+4? Use the add tool." → ``add(3, 4)``, then "7"; "Add
two and three." → an ``add`` call whose arguments are a string), served by the embedded engine behind
the smg router.
"""

import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("openenv.core")

from agent_script import ASK_ADD, ASK_BAD  # noqa: E402
from openenv_envs import CalculatorEnv, calculator_app  # noqa: E402

from slime.agent.openenv import EnvFailure, EnvSettings, keep_scored_groups, serve_env  # noqa: E402
from slime.agent.openenv.rollout import call_arguments, model_tools  # noqa: E402
from slime.agent.openenv.session import episode_for, turn_outcome  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def env_server():
    handle = serve_env(calculator_app(max_concurrent_envs=16))
    yield handle
    handle.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _play(settings, task_id="add-3-4"):
    episode = episode_for(settings)
    await episode.open({"task_id": task_id, "seed": 5})
    try:
        names = sorted(t["name"] for t in await episode.list_tools())
        added = await episode.call_tool("add", {"a": 3, "b": 4})
        bad = await episode.call_tool("add", {"a": "x"})
        first = turn_outcome(await episode.call_tool("end_turn", {"response": "8"}))
        second = turn_outcome(await episode.call_tool("end_turn", {"response": " 7\n"}))
    finally:
        await episode.close()
    return names, added, bad, first, second


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_one_episode_by_hand(env_server, transport):
    names, added, bad, first, second = asyncio.run(_play(EnvSettings(url=env_server.url, transport=transport)))
    assert names == ["add", "end_turn", "start_episode"]  # MCP tools/list, the harness's tools included
    assert (added.text, added.is_error, added.structured) == ("7", False, {"result": 7})
    assert bad.is_error and "valid integer" in bad.text  # the env's own argument validation, as an error answer
    assert first == (False, None, "That is not right. Try again.")  # not done: the env's next prompt
    assert second == (True, 1.0, None)
    assert ("add-3-4", 5) in CalculatorEnv.opened  # reset (ws) / start_episode (http) got the row's task


def test_model_tools_and_arguments():
    env_tools = [{"name": "add", "description": "Add.", "input_schema": {"type": "object"}},
                 {"name": "end_turn", "description": "", "input_schema": {}},
                 {"name": "mul", "description": "Multiply.", "input_schema": {"type": "object"}}]
    tools = model_tools(env_tools, None)
    assert [t["function"]["name"] for t in tools] == ["add", "mul"]  # the harness's end_turn is never offered
    assert [t["function"]["name"] for t in model_tools(env_tools, ["mul"])] == ["mul"]  # the row's subset
    assert call_arguments("add", '{"a": 1, "b": 2}', {"add"}) == ({"a": 1, "b": 2}, None)
    for raw in ('"two and three"', '{"_raw_arguments": "two and three"}', "[1, 2]", "a=1"):
        arguments, why = call_arguments("add", raw, {"add"})
        assert arguments is None and why.startswith("error: the arguments of add must be a JSON object"), raw
    assert call_arguments("sub", "{}", {"add"})[1] == "error: unknown tool 'sub'; the tools are: add"


def test_session_limit_is_waited_out_within_reset_timeout():
    handle = serve_env(calculator_app(max_concurrent_envs=1))
    try:
        async def scenario():
            holder = episode_for(EnvSettings(url=handle.url))
            await holder.open({"task_id": "add-1-1"})
            with pytest.raises(EnvFailure, match="reset_timeout=0.5"):  # full for longer than reset_timeout
                await episode_for(EnvSettings(url=handle.url, reset_timeout=0.5)).open({"task_id": "add-1-2"})
            waiter = episode_for(EnvSettings(url=handle.url, reset_timeout=20))
            opening = asyncio.create_task(waiter.open({"task_id": "add-1-3"}))
            await asyncio.sleep(1.0)
            assert not opening.done()  # still waiting for the one session
            await holder.close()
            await asyncio.wait_for(opening, 10)
            assert (await waiter.call_tool("add", {"a": 1, "b": 3})).text == "4"
            await waiter.close()

        asyncio.run(scenario())
    finally:
        handle.stop()


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_a_restarting_server_is_waited_out(transport):
    port = _free_port()
    handles = []

    def start_later():
        time.sleep(1.5)
        handles.append(serve_env(calculator_app(), port=port))

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        settings = EnvSettings(url=f"http://127.0.0.1:{port}", transport=transport, reset_timeout=30)
        names, *_, second = asyncio.run(_play(settings))
        assert "add" in names and second == (True, 1.0, None)
    finally:
        starter.join()
        for handle in handles:
            handle.stop()


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_token(transport, monkeypatch):
    import httpx

    with pytest.raises(ValueError, match="requires a token"):
        serve_env(calculator_app(), host="0.0.0.0")
    handle = serve_env(calculator_app(), token="s3cret")
    try:
        assert httpx.get(handle.url + "/health", trust_env=False).status_code == 401
        assert httpx.get(handle.url + "/health", headers={"Authorization": "Bearer wrong"},
                         trust_env=False).status_code == 401
        started = time.monotonic()
        with pytest.raises(EnvFailure, match="401|403"):  # refused at once, not retried: a token does not appear
            asyncio.run(episode_for(EnvSettings(url=handle.url, transport=transport, reset_timeout=30)).open({}))
        assert time.monotonic() - started < 5
        monkeypatch.setenv("CALC_TOKEN", "s3cret")
        settings = EnvSettings.from_metadata({"server": {"url": handle.url, "transport": transport,
                                                         "token_env": "CALC_TOKEN"}})
        assert settings.token == "s3cret"
        assert asyncio.run(_play(settings))[-1] == (True, 1.0, None)
    finally:
        handle.stop()
    with pytest.raises(ValueError, match="UNSET_TOKEN"):
        EnvSettings.from_metadata({"server": {"url": "http://h:1", "token_env": "UNSET_TOKEN"}})


# ----------------------------------------------------------------------------- the rollout, model in the loop


@pytest.fixture(scope="module")
def router(engine):
    from slime.backends.router import running_router

    with running_router(policy="consistent_hashing", worker_urls=[engine.url]) as proc:
        yield proc


def _rows(path, server, rows):
    with open(path, "w") as f:
        for i, (question, task_id) in enumerate(rows):
            f.write(json.dumps({"messages": [{"role": "user", "content": question}], "metadata": {
                "split": "train", "index": i, "task_id": task_id, "max_turns": 3,
                "server": {"url": server.url, "transport": "ws" if i % 2 == 0 else "http"}}}) + "\n")


def _args(model_dir, data, router, extra=()):
    from slime.arguments import parse_args

    host, port = router.url.rsplit("//", 1)[1].split(":")
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
        "--prompt-data", str(data), "--input-key", "messages", "--metadata-key", "metadata",
        "--custom-generate-function-path", "slime.agent.openenv.generate", "--sglang-tool-call-parser", "qwen25",
        "--router-policy", "consistent_hashing", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24",
        "--rollout-max-context-len", "480", "--num-rollout", "1", "--rollout-temperature", "0.01",
        "--sglang-router-ip", host, "--sglang-router-port", port, *extra,
    ])  # fmt: skip
    return args


def test_one_rollout_step_through_the_router(engine, router, scripted_model_dir, tokenizer, env_server, tmp_path):
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import generate_rollout

    data = tmp_path / "train.jsonl"
    # the scripted answer is right for add-3-4, wrong for add-4-4 (the env asks again, then done with 0), and
    # the arguments of ASK_BAD are not an object
    _rows(data, env_server, [(ASK_ADD, "add-3-4"), (ASK_ADD, "add-4-4"), (ASK_BAD, "add-2-3")])
    args = _args(scripted_model_dir, data, router, ["--rollout-batch-size", "3"])
    args.rollout_engine_urls = [engine.url]
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))

    by_task = {}
    for group in output.samples:
        assert len(group) == 2 and all(isinstance(episode, list) and episode for episode in group)
        for episode in group:
            assert len({s.rollout_id for s in episode}) == 1 and len({s.reward for s in episode}) == 1
            for sample in episode:
                assert sample.status == Sample.Status.COMPLETED and sample.metadata["openenv_failure"] is None
                assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
                assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
                json.dumps(sample.metadata)
            by_task.setdefault(episode[0].metadata["task_id"], []).append(episode)
    assert sorted(by_task) == ["add-2-3", "add-3-4", "add-4-4"]
    for episode in by_task["add-3-4"]:  # add(3, 4) ran on the env, "7" went to end_turn: verified, done
        meta = episode[0].metadata
        assert (episode[0].reward, meta["openenv_done"], meta["openenv_tool_calls"], meta["openenv_turns"]) == \
            (1.0, True, 1, 2)
    def text(episode):
        return "".join(tokenizer.decode(s.tokens) for s in episode)

    for episode in by_task["add-4-4"]:  # "7" is wrong: the env answered its next prompt, the model tried again
        meta = episode[0].metadata
        assert episode[0].reward == 0.0 and meta["openenv_tool_calls"] >= 1 and meta["openenv_turns"] == 3
        assert "That is not right. Try again." in text(episode)
    for episode in by_task["add-2-3"]:  # a string for arguments: answered to the model, never sent to the env
        assert episode[0].metadata["openenv_invalid_calls"] >= 1 and episode[0].reward == 0.0
        assert "error: the arguments of add must be a JSON object" in text(episode)


def test_a_failed_episode_leaves_its_group_out(engine, router, scripted_model_dir, env_server, tmp_path):
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import generate_rollout

    data = tmp_path / "train.jsonl"
    _rows(data, env_server, [(ASK_ADD, "crash-1"), (ASK_ADD, "add-3-4")])  # crash-1's end_turn raises
    args = _args(scripted_model_dir, data, router, ["--rollout-batch-size", "1", "--dynamic-sampling-filter-path",
                                                    "slime.agent.openenv.keep_scored_groups"])
    args.rollout_engine_urls = [engine.url]
    closed_before = CalculatorEnv.closed.count("crash-1")
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert output.metrics == {"rollout/dynamic_filter/drop_env_failed": 1}  # crash-1 left out, add-3-4 drawn
    (group,) = output.samples
    assert {episode[0].metadata["task_id"] for episode in group} == {"add-3-4"}
    assert all(episode[0].reward == 1.0 for episode in group)
    assert CalculatorEnv.closed.count("crash-1") == closed_before + 2  # both failed episodes were torn down


def test_failed_episode_placeholder_and_filter(router, scripted_model_dir, tmp_path):
    from slime.agent.openenv import generate

    prompts = tmp_path / "unused.jsonl"  # parse_args checks that the prompt file exists; the sample below is built by hand
    prompts.write_text(json.dumps({"prompt": "unused", "metadata": {}}) + "\n")
    args = _args(scripted_model_dir, prompts, router, ["--rollout-batch-size", "1"])
    sample = Sample(index=0, prompt=[{"role": "user", "content": ASK_ADD}],
                    metadata={"task_id": "add-3-4", "server": {"url": f"http://127.0.0.1:{_free_port()}",
                                                               "reset_timeout": 0.3}})  # nothing listens there
    out = asyncio.run(generate(args, sample, {"temperature": 0.01, "max_new_tokens": 24}))
    assert out is sample and out.status == Sample.Status.ABORTED and out.remove_sample and out.reward == 0.0
    assert out.metadata["openenv_failure"].startswith("env:") and "reset_timeout" in out.metadata["openenv_failure"]
    assert keep_scored_groups(args, [[out], [Sample(metadata={})]]).reason == "env_failed"
    assert keep_scored_groups(args, [Sample(metadata={"openenv_failure": None})]).keep

"""The OpenEnv example (``examples/openenv_tools/``): its env server and rows, and one real rollout step
of it — the example's thermometer env served by openenv-core, the example's rows, the tiny model with
the example's compact template, taught (greedy) to call ``get_temperature`` and then repeat the reading,
so every episode is known in advance and must score 1.0 by the env's verifier."""

import asyncio
import json
import shutil

import pytest

pytest.importorskip("openenv.core")

from agent_script import teach_script  # noqa: E402

from examples.openenv_tools.data import MAX_TURNS, build  # noqa: E402
from examples.openenv_tools.env import app, reading  # noqa: E402
from examples.tool_use.task import QUESTION, TOOLS, tool_transcript  # noqa: E402
from slime.agent.openenv import EnvSettings, serve_env  # noqa: E402
from slime.agent.openenv.session import episode_for, turn_outcome  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # the tiny model is taught its script first (seconds idle, minutes on busy cores)


@pytest.fixture(scope="module")
def thermometer():
    handle = serve_env(app())
    yield handle
    handle.stop()


def test_env_and_rows(thermometer, tmp_path):
    paths = build(tmp_path, thermometer.url, num_train=20, num_eval=10, num_sft=30)
    with open(paths["train"]) as f:
        train = [json.loads(line) for line in f]
    row = train[3]
    assert row["messages"] == [{"role": "user", "content": QUESTION}]
    assert set(row["metadata"]) == {"split", "index", "task_id", "max_turns", "server"}  # no reading: only the env has it
    assert row["metadata"]["task_id"] == "train-3" and row["metadata"]["max_turns"] == MAX_TURNS
    assert row["metadata"]["server"]["url"] == thermometer.url
    assert len({reading(f"train-{i}") for i in range(20)}) > 5  # readings spread over the tasks

    async def episode(task_id, answer_with_reading):
        ep = episode_for(EnvSettings(url=thermometer.url))
        await ep.open({"task_id": task_id})
        try:
            tools = [t["name"] for t in await ep.list_tools()]
            shown = (await ep.call_tool("get_temperature", {})).text
            outcome = turn_outcome(await ep.call_tool("end_turn", {"response": shown if answer_with_reading
                                                                   else str((int(shown) + 1) % 10)}))
        finally:
            await ep.close()
        return tools, shown, outcome

    tools, shown, outcome = asyncio.run(episode("train-3", True))
    assert sorted(tools) == ["end_turn", "get_temperature"] and shown == reading("train-3")
    assert outcome == (True, 1.0, None)
    assert asyncio.run(episode("train-3", False))[2] == (True, 0.0, None)


@pytest.fixture(scope="module")
def thermometer_model(tiny_model_dir, tmp_path_factory):
    from examples.tool_use.template import install

    compact = tmp_path_factory.mktemp("thermo") / "compact"
    shutil.copytree(tiny_model_dir, compact)
    install(compact)
    call = '<tool_call>\n{"name": "get_temperature", "arguments": {}}\n</tool_call><|im_end|>'
    readings = sorted({reading(f"train-{i}") for i in range(3)})  # those of the step's tasks (copying all ten
    # readings takes the tiny model far longer to learn than a test may run)
    script = [(tool_transcript("0")[:1], call)] + [(tool_transcript(t)[:3], f"{t}<|im_end|>") for t in readings]
    return str(teach_script(str(compact), compact.parent / "taught", script=script, tools=TOOLS))


def test_one_rollout_step_of_the_example(thermometer, thermometer_model, tmp_path):
    from slime.backends.embedded_engine.serving.launch import running_engine
    from slime.backends.router import running_router
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import generate_rollout
    from slime.arguments import parse_args

    paths = build(tmp_path / "data", thermometer.url, num_train=3, num_eval=1, num_sft=1)
    with running_engine(thermometer_model, extra_args=["--context-length", "512"]) as engine, \
            running_router("consistent_hashing", worker_urls=[engine.url]) as router:
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", thermometer_model,
            "--prompt-data", paths["train"], "--input-key", "messages", "--metadata-key", "metadata",
            "--custom-generate-function-path", "slime.agent.openenv.generate",
            "--dynamic-sampling-filter-path", "slime.agent.openenv.keep_scored_groups",
            "--sglang-tool-call-parser", "qwen25", "--router-policy", "consistent_hashing",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "32",
            "--rollout-max-context-len", "512", "--num-rollout", "1", "--rollout-temperature", "0.01",
            "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
        ])  # fmt: skip
        args.rollout_engine_urls = [engine.url]
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert output.metrics is None  # no group left out: the env never failed
    tasks = set()
    for group in output.samples:
        for episode in group:
            meta = episode[0].metadata
            tasks.add(meta["task_id"])
            # the env's own reading, fetched by the call and repeated: scored 1.0 by the env's verifier
            assert (meta["openenv_tool_calls"], meta["openenv_turns"], meta["openenv_done"]) == (1, 2, True)
            assert all(s.reward == 1.0 and s.status == Sample.Status.COMPLETED for s in episode)
            assert reading(meta["task_id"]) in "".join(s.response for s in episode)
    assert tasks == {"train-0", "train-1", "train-2"}

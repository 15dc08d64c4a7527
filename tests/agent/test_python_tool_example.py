"""examples/python_tool: the sandbox's limits, the task files, and one real rollout step.

The rollout step serves the tiny model taught (``agent_script.teach_script``) to answer "x is in
python. How long is x?" with a ``python`` call printing ``len(x)`` and, once the tool answered, with
that answer. The code really runs in the sandbox with the row's list defined: the tool's answer the
model copies is the child process's output (3 for the row's ``x = [4, 0, 7]``), and the reward is the
final answer against the label (right for "3", wrong for "4").
"""

import json

import pytest
from agent_script import teach_script

from examples.python_tool.generate import run_tool
from examples.python_tool.sandbox import run_python
from examples.python_tool.task import GUESS, PREAMBLE, QUESTIONS, TOOLS, build, prelude
from slime.backends.embedded_engine.serving.launch import running_engine
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.arguments import parse_args
from slime.utils.types import Sample

pytestmark = pytest.mark.timeout(300)


def test_sandbox_runs_code_and_enforces_its_limits(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_SECRET", "s3cret")
    assert run_python("print(12*34)") == "408"
    assert run_python("import math\nprint(math.isqrt(17))") == "4"
    assert run_python("while True: pass", cpu_s=1, wall_s=10) == "error: the code used more than 1 s of CPU time"
    assert run_python("import time; time.sleep(30)", wall_s=1) == "error: the code ran longer than 1 s and was stopped"
    assert run_python("x = bytearray(1 << 31)", memory_mb=256) == "error: MemoryError"
    assert "socket" in run_python("import socket; socket.socket().connect(('127.0.0.1', 9))")
    assert "not allowed" in run_python("import urllib.request; urllib.request.urlopen('http://127.0.0.1:9')")
    assert "subprocess.Popen is not allowed" in run_python("import subprocess; subprocess.run(['true'])")
    assert "os.system is not allowed" in run_python("import os; os.system('true')")
    outside = tmp_path / "escaped.txt"
    assert "outside the working directory" in run_python(f"open({str(outside)!r}, 'w').write('x')")
    assert not outside.exists()
    assert run_python("open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())") == "ok"
    assert "TRAINER_SECRET" not in run_python("import os; print(sorted(os.environ))")  # not the trainer's environment
    assert run_python("1/0") == "error: ZeroDivisionError: division by zero"
    assert run_python("print('x' * 5000)", max_output=100) == "x" * 100
    assert run_python("  ").startswith("error: the code is empty")


def test_tool_answers_bad_calls_with_the_reason():
    assert run_tool("python", '{"code": "print(2+3)"}') == ("5", {"code": "print(2+3)"})
    answer, parsed = run_tool("python", "print(2+3)")  # not JSON
    assert parsed is None and answer.startswith('error: the arguments of python must be a JSON object with a "code"')
    assert run_tool("python", '{"source": "1"}')[0].startswith("error: the arguments of python")
    assert run_tool("bash", "{}")[0] == "error: unknown tool 'bash'; the only tool is python"
    # the row's data is defined before the snippet; without it the snippet does not see x
    assert run_tool("python", '{"code": "print(sum(x)%10)"}', [4, 0, 7])[0] == "1"
    assert run_tool("python", '{"code": "print(len(x))"}')[0] == "error: NameError: name 'x' is not defined"


def test_task_files(tmp_path):
    paths = build(tmp_path, seed=0, num_train=50, num_eval=20, num_sft=40, sft_tool_fraction=0.25)
    rows = {k: [json.loads(line) for line in open(paths[k])] for k in ("train", "eval", "sft")}
    assert [len(rows[k]) for k in ("train", "eval", "sft")] == [50, 20, 40]
    problems = [(r["messages"][0]["content"], tuple(r["metadata"]["x"])) for r in rows["train"] + rows["eval"]]
    assert len(set(problems)) == 70  # eval problems are not train problems
    for row in rows["train"] + rows["eval"]:
        question = row["messages"][0]["content"]
        assert question.startswith(PREAMBLE) and str(row["metadata"]["x"]) not in question  # x is not shown
        code = QUESTIONS[question[len(PREAMBLE):]][0]
        assert run_python(prelude(row["metadata"]["x"]) + code) == row["label"] and row["tools"] == TOOLS
    assert len({r["messages"][0]["content"] for r in rows["train"]}) == len(QUESTIONS)
    looked_up = [r for r in rows["sft"] if len(r["messages"]) == 4]
    assert len(looked_up) == 10
    user, call, tool, answer = looked_up[0]["messages"]
    assert call["tool_calls"][0]["function"]["arguments"]["code"] == QUESTIONS[user["content"][len(PREAMBLE):]][0]
    assert tool["content"] == answer["content"]
    assert all(r["messages"][1]["content"] == GUESS for r in rows["sft"] if len(r["messages"]) == 2)
    with pytest.raises(ValueError, match="--sft-tool-fraction"):
        build(tmp_path, sft_tool_fraction=1.5)


ASK = PREAMBLE + "How long is x?"
CODE = {"code": "print(len(x))"}
X = [4, 0, 7]
SCRIPT = [
    ([{"role": "user", "content": ASK}],
     '<tool_call>\n{"name": "python", "arguments": ' + json.dumps(CODE) + "}\n</tool_call><|im_end|>"),
    ([{"role": "user", "content": ASK},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": CODE}}]},
      {"role": "tool", "content": "3"}], "3<|im_end|>"),
]


def test_one_rollout_step(tiny_model_dir, tmp_path):
    pytest.importorskip("openai")
    from slime.backends.router import running_router

    import shutil

    from examples.tool_use.template import install

    compact = tmp_path / "compact"  # the example's one-line tool list: short sequences, quick to teach
    shutil.copytree(tiny_model_dir, compact)
    install(compact)
    model_dir = str(teach_script(str(compact), tmp_path / "taught", script=SCRIPT, tools=TOOLS))
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:  # the taught question, once with its right label, once with a wrong one
        for label in ("3", "4"):
            f.write(json.dumps({"messages": [{"role": "user", "content": ASK}], "tools": TOOLS, "label": label,
                                "metadata": {"x": X}}) + "\n")
    with running_engine(model_dir, extra_args=["--context-length", "256"]) as engine, \
            running_router("consistent_hashing", worker_urls=[engine.url]) as router:
        args = parse_args([
            "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", model_dir,
            "--prompt-data", str(data), "--input-key", "messages", "--label-key", "label", "--tool-key", "tools",
            "--custom-generate-function-path", "examples.python_tool.generate.generate",
            "--custom-rm-path", "examples.tool_use.reward.reward", "--sglang-tool-call-parser", "qwen25",
            "--router-policy", "consistent_hashing",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "32",
            "--rollout-max-context-len", "256", "--num-rollout", "1", "--rollout-temperature", "0.01",
            "--sglang-router-ip", router.host, "--sglang-router-port", str(router.port),
        ])  # fmt: skip
        args.rollout_engine_urls = [engine.url]
        output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))

    rewards = {}
    for group in output.samples:
        for episode in group:
            assert isinstance(episode, list) and episode and len({s.rollout_id for s in episode}) == 1
            for sample in episode:
                assert sample.status == Sample.Status.COMPLETED
                # the code ran in the sandbox and its output is what the model was shown and copied
                assert sample.metadata["tool_calls"] == [{"name": "python", "arguments": CODE, "result": "3"}]
                assert sample.metadata["final_answer"] == "3" and sample.metadata["turns"] == 2
                assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
                assert 0 < sum(sample.loss_mask) < sample.response_length  # the tool's answer is not trained
            rewards.setdefault(episode[0].label, set()).add(episode[0].reward)
    assert rewards == {"3": {1.0}, "4": {0.0}}

"""The tool-use example (``examples/tool_use/``): its task files, template, tool service, reward, and
its generate function inside one real rollout step (``generate_rollout``) against the embedded engine.

The engine serves the tiny model taught ``agent_script.py`` (greedy: "What is 3+4? Use the add
tool." → ``add(3, 4)``, then "7" once the tool answers), so the episodes are known in advance; the
example's tool service is swapped for a calculator there (the scripted model knows only ``add``).
The example must run the episodes through the OpenAI adapter, execute the calls, and score the
final answers.
"""

import json

import pytest
from agent_script import ASK_ADD, CHAT_TOOLS

import examples.tool_use.generate as example_generate
from examples.tool_use.reward import score
from examples.tool_use.summary import summarise
from examples.tool_use.task import GUESS, QUESTION, TOOLS, build
from examples.tool_use.template import compact_template
from slime.observability.rollout_data_utils import save_debug_rollout_data
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import generate_rollout
from slime.arguments import parse_args
from slime.utils.tiny_model import CHAT_TEMPLATE
from slime.utils.types import Sample

pytestmark = pytest.mark.timeout(300)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_task_files(tmp_path):
    paths = build(tmp_path, seed=0, num_train=100, num_eval=30, num_sft=40, sft_tool_fraction=0.25)
    train, evals, sft = (_rows(paths[k]) for k in ("train", "eval", "sft"))
    assert (len(train), len(evals), len(sft)) == (100, 30, 40)
    for row in train + evals:
        assert row["messages"] == [{"role": "user", "content": QUESTION}]
        assert row["label"] == row["metadata"]["temperature"] and row["label"].isdigit()
        assert row["tools"][0]["function"]["name"] == "get_temperature"
    assert len({r["label"] for r in train}) == 10  # readings spread over 0..9, so a fixed guess is right 1 in 10
    assert [r["label"] for r in evals] != [r["label"] for r in train[:30]]  # eval readings drawn apart
    looked_up = [r for r in sft if len(r["messages"]) == 4]
    assert len(looked_up) == 10  # 25% of the demonstrations read the sensor, the rest answer GUESS without it
    assert all(r["messages"][1] == {"role": "assistant", "content": GUESS} for r in sft if len(r["messages"]) == 2)
    user, call, tool, answer = looked_up[0]["messages"]
    assert call["tool_calls"][0]["function"] == {"name": "get_temperature", "arguments": {}}
    assert tool["content"] == answer["content"] and tool["content"].isdigit()
    with pytest.raises(ValueError, match="sft-tool-fraction"):
        build(tmp_path, sft_tool_fraction=1.5)


def test_compact_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = compact_template(CHAT_TEMPLATE)
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_temperature", "arguments": {}}}]},
                {"role": "tool", "content": "7"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS + CHAT_TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nTools: get_temperature() add(a, b)<|im_end|>\n"
                    f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
                    '<|im_start|>assistant\n<tool_call>\n{"name": "get_temperature", "arguments": {}}\n'
                    "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="tool preamble"):
        compact_template("{{ messages }}")


def test_tool_service_and_reward():
    run_tool = example_generate.run_tool
    assert run_tool("get_temperature", "{}", "7") == ("7", {})
    answer, parsed = run_tool("get_temperature", "now", "7")  # not JSON: answered, not raised
    assert parsed is None and answer.startswith("error: the arguments of get_temperature must be a JSON object")
    assert run_tool("add", '{"a": 1}', "7")[0] == "error: unknown tool 'add'; the only tool is get_temperature"
    assert score("7", " 7\n") == 1.0 and score("7", "5") == 0.0 and score("7", None) == 0.0


def test_one_rollout_step_of_the_example(engine, scripted_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("openai")

    def calculator(name, arguments, temperature):
        parsed = json.loads(arguments)
        return str(parsed["a"] + parsed["b"]), parsed

    monkeypatch.setattr(example_generate, "run_tool", calculator)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:  # the scripted question, once with its right label, once with a wrong one
        for label in ("7", "8"):
            f.write(json.dumps({"messages": [{"role": "user", "content": ASK_ADD}], "tools": CHAT_TOOLS,
                                "label": label}) + "\n")
    host, port = engine.url.rsplit("//", 1)[1].split(":")
    args = parse_args([
        "--train-backend", "fsdp", "--rollout-backend", "embedded", "--hf-checkpoint", scripted_model_dir,
        "--prompt-data", str(data), "--input-key", "messages", "--label-key", "label", "--tool-key", "tools",
        "--custom-generate-function-path", "examples.tool_use.generate.generate",
        "--custom-rm-path", "examples.tool_use.reward.reward", "--sglang-tool-call-parser", "qwen25",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24",
        "--rollout-max-context-len", "480", "--num-rollout", "1", "--rollout-temperature", "0.01",
        "--sglang-router-ip", host, "--sglang-router-port", port,
    ])  # fmt: skip
    args.rollout_engine_urls = [engine.url]
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))

    assert len(output.samples) == 2
    rewards = {}
    for group in output.samples:
        assert len(group) == 2 and all(isinstance(episode, list) and episode for episode in group)
        for episode in group:
            assert len({s.rollout_id for s in episode}) == 1 and len({s.reward for s in episode}) == 1
            for sample in episode:
                assert sample.status == Sample.Status.COMPLETED
                # the episode the script dictates: one add call, executed by the tool service, then "7"
                assert sample.metadata["tool_calls"] == [{"name": "add", "arguments": {"a": 3, "b": 4}, "result": "7"}]
                assert sample.metadata["final_answer"] == "7" and sample.metadata["turns"] == 2
                assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
                assert len(sample.tokens) <= 480 and sample.tokens[:len(sample.tokens) - sample.response_length]
                assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
                json.dumps(sample.metadata)  # plain data, dumpable with the rollout
            rewards.setdefault(episode[0].label, set()).add(episode[0].reward)
    assert rewards == {"7": {1.0}, "8": {0.0}}  # the reward is the final answer against the label

    flat = [s for group in output.samples for episode in group for s in episode]
    save_debug_rollout_data(str(tmp_path / "out" / "dumps" / "rollout_{rollout_id}.pt"), flat, rollout_id=0,
                            evaluation=False)
    step = summarise(str(tmp_path / "out"))["steps"][0]
    assert (step["episodes"], step["reward"], step["tool_rate"], step["reward_with_tool"]) == (4, 0.5, 1.0, 0.5)

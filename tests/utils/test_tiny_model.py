import json
from pathlib import Path

import pyarrow.parquet as pq
import torch


def test_tiny_model_loads_offline_and_is_deterministic(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.utils.tiny_model import build_tiny_model, count_parameters

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen3"
    assert 500_000 < count_parameters(tiny_model_dir) < 5_000_000
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "What is 12+34? Answer: 46 {\"city\": \"Paris\"}"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    # digits are single tokens
    assert len(tokenizer("12345")["input_ids"]) == 5
    generation = json.loads(Path(tiny_model_dir, "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # same seed -> identical weights
    again = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "again", seed=0))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_chat_template_two_turns_and_tools(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == ("<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
                        "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    with_tools = tokenizer.apply_chat_template(messages[:1] + [call, {"role": "tool", "content": "sunny"}], tools=tools, tokenize=False)
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in with_tools
    assert "<tool_response>\nsunny\n</tool_response>" in with_tools


def test_task_data_files(tiny_task_data):
    rows = [json.loads(line) for line in open(tiny_task_data["train"])]
    assert len(rows) == 64
    question = rows[0]["prompt"][0]["content"]
    a, b = question.rstrip("=").split("+")
    assert rows[0]["label"] == str(int(a) + int(b)) and rows[0]["prompt"][0]["role"] == "user"
    assert pq.read_table(tiny_task_data["train_parquet"]).to_pylist() == rows
    evals = {json.loads(line)["prompt"][0]["content"] for line in open(tiny_task_data["eval"])}
    trains = {r["prompt"][0]["content"] for r in rows}
    assert len(evals) == 16 and not evals & trains
    sft = [json.loads(line) for line in open(tiny_task_data["sft"])]
    assert sft[0]["messages"][-1]["role"] == "assistant"

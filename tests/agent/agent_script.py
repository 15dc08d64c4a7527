"""The tool-use script the agent-adapter tests teach the tiny model, and helpers to render it.

The script (greedy decoding reproduces it exactly, checked at build time):
* "What is 3+4? Use the add tool." → a well-formed ``add`` call; after the tool answers "7" → "7".
* "Think, then add 5 and 6." → a ``<think>`` block, then an ``add`` call (the chat template drops the
  reasoning when it re-renders history, so the next prompt does not extend the sampled tokens).
* "Add two and three." → an ``add`` call whose arguments are a string, not a JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
ADD_DESCRIPTION = "Add two integers."
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": ADD_DESCRIPTION,
                                                "parameters": ADD_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "add", "description": ADD_DESCRIPTION, "input_schema": ADD_SCHEMA}]

ASK_ADD = "What is 3+4? Use the add tool."
ASK_THINK = "Think, then add 5 and 6."
ASK_BAD = "Add two and three."


def call_text(arguments) -> str:
    return '<tool_call>\n{"name": "add", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


def canonical_call(arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": arguments}}]}


SCRIPT = [  # (messages, reply) pairs the model is taught
    ([{"role": "user", "content": ASK_ADD}], call_text({"a": 3, "b": 4}) + "<|im_end|>"),
    ([{"role": "user", "content": ASK_ADD}, canonical_call({"a": 3, "b": 4}), {"role": "tool", "content": "7"}],
     "7<|im_end|>"),
    ([{"role": "user", "content": ASK_THINK}], "<think>\nuse add\n</think>\n" + call_text({"a": 5, "b": 6}) + "<|im_end|>"),
    ([{"role": "user", "content": ASK_BAD}], call_text("two and three") + "<|im_end|>"),
]


def render_ids(tokenizer, messages, tools=CHAT_TOOLS) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def teach_script(model_dir: str, out_dir: Path, script=SCRIPT, tools=CHAT_TOOLS) -> Path:
    """A copy of the model taught ``script`` (``(messages, reply)`` pairs rendered with ``tools``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = [(render_ids(tokenizer, messages, tools), tokenizer.encode(reply, add_special_tokens=False))
             for messages, reply in script]
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100)
    attention = torch.zeros(len(pairs), width, dtype=torch.long)
    for row, (prompt, reply) in enumerate(pairs):
        n = len(prompt) + len(reply)
        ids[row, :n] = torch.tensor(prompt + reply)
        labels[row, len(prompt):n] = torch.tensor(reply)
        attention[row, :n] = 1
    torch.manual_seed(0)
    # the same thread count (so the same reduction order and number of steps) whichever test ran before
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    try:
        model = _teach(model_dir, ids, labels, attention, pairs)
    finally:
        torch.set_num_threads(threads)
    shutil.copytree(model_dir, out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _teach(model_dir, ids, labels, attention, pairs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    # until the loss is that of a model sure of every reply token: a model that has not yet learned to copy
    # a tool's answer sits on a plateau for a few hundred steps (two 50/50 digits of 24 tokens: loss
    # 2 ln 2 / 24 = 0.058), where greedy decoding may reproduce the script by chance but the engine need not
    for step in range(1, 1001):
        loss = model(ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.02:
            break
    model.eval()
    with torch.no_grad():
        for prompt, reply in pairs:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(reply), do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
            assert out[0, len(prompt):].tolist() == reply, (
                f"the tiny model did not learn the script in {step} steps (loss {loss.item()})")
    return model


"""The adapters' pending options of docs/INTERFACES.md §6.8.

* ``OpenAIAdapter(preserve_parallel_tool_calls=True)``: a turn with two tool calls is answered with both (Chat
  Completions and Responses), and a client that runs both and echoes them continues the same sample — the
  default adapter answers with the first call only.
* The SGLang call retries once when it could not connect (nothing reached the server), e.g. a router restarting.

The model's turns are scripted through the adapter's documented seam (``common.call_sglang_generate``): the
first turn's output is exactly what the chat template renders for an assistant message with the two calls, so
the echoed history extends the sampled tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from agent_script import CHAT_TOOLS
from slime.agent.adapters import OpenAIAdapter, common
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.trajectory import TurnRecord
from slime.utils.types import Sample

openai = pytest.importorskip("openai")
ASK = "Add 3 and 4, and 5 and 6."
CALLS = [{"name": "add", "arguments": {"a": 3, "b": 4}}, {"name": "add", "arguments": {"a": 5, "b": 6}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def assistant_text(tokenizer, message: dict) -> str:
    """What the chat template renders for ``message`` after the generation prompt (through its end token)."""
    user = [{"role": "user", "content": ASK}]
    prompt = tokenizer.apply_chat_template(user, tools=CHAT_TOOLS, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(user + [message], tools=CHAT_TOOLS, tokenize=False)
    assert whole.startswith(prompt)
    text = whole[len(prompt):]
    return text[: text.index(tokenizer.eos_token) + len(tokenizer.eos_token)]


@pytest.fixture
def scripted(monkeypatch, tokenizer):
    """The engine's answers, in order: both calls, then the final text."""
    calls_message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": call} for call in CALLS]}
    outputs = [assistant_text(tokenizer, calls_message), "7 and 11" + tokenizer.eos_token]

    async def fake_generate(prompt_ids, session, body, *, adapter, session_id=None):
        ids = tokenizer.encode(outputs.pop(0), add_special_tokens=False)
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, finish_reason="stop",
                          output_log_probs=[-0.25] * len(ids))
    monkeypatch.setattr(common, "call_sglang_generate", fake_generate)
    return outputs


def serve(tokenizer, **kwargs):
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://127.0.0.1:9", tool_parser="qwen25", **kwargs)
    return adapter, run_app_in_thread(adapter.app)


def finish(adapter, sid):
    return asyncio.run(adapter.finish_session(sid, base_sample=Sample(index=0, prompt=ASK), reward=1.0))


@pytest.mark.parametrize("preserve", [True, False])
def test_chat_completions_answers_every_parallel_call_and_the_echo_continues_one_sample(tokenizer, scripted, preserve):
    adapter, handle = serve(tokenizer, preserve_parallel_tool_calls=preserve)
    try:
        adapter.open_session("par-1")
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="par-1", max_retries=0)
        messages = [{"role": "user", "content": ASK}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS).choices[0]
        calls = first.message.tool_calls
        assert first.finish_reason == "tool_calls"
        got = [(c.function.name, c.function.arguments) for c in calls]
        want = [("add", '{"a": 3, "b": 4}'), ("add", '{"a": 5, "b": 6}')]
        assert got == (want if preserve else want[:1])
        if not preserve:
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": answer} for c, answer in zip(calls, ["7", "11"])]
        second = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS).choices[0]
        assert second.message.content == "7 and 11"
        [sample] = finish(adapter, "par-1")
        first_ids = tokenizer.encode(assistant_text(tokenizer, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": call} for call in CALLS]}), add_special_tokens=False)
        last_ids = tokenizer.encode("7 and 11" + tokenizer.eos_token, add_special_tokens=False)
        # both turns trained in one sample, the tool answers between them not
        assert sum(sample.loss_mask) == len(first_ids) + len(last_ids)
        response = sample.tokens[-sample.response_length:]
        assert response[: len(first_ids)] == first_ids and response[-len(last_ids):] == last_ids
        assert sample.loss_mask[: len(first_ids)] == [1] * len(first_ids)
    finally:
        handle.stop()


def test_responses_api_answers_every_parallel_call_as_function_call_items(tokenizer, scripted):
    adapter, handle = serve(tokenizer, preserve_parallel_tool_calls=True)
    try:
        adapter.open_session("par-2")
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="par-2", max_retries=0)
        tools = [{"type": "function", **CHAT_TOOLS[0]["function"]}]
        first = client.responses.create(model="policy", input=ASK, tools=tools)
        items = [item for item in first.output if item.type == "function_call"]
        assert [(i.name, i.arguments) for i in items] == [("add", '{"a": 3, "b": 4}'), ("add", '{"a": 5, "b": 6}')]
        follow = [{"role": "user", "content": ASK}, *[item.model_dump() for item in items],
                  *[{"type": "function_call_output", "call_id": i.call_id, "output": out} for i, out in zip(items, ["7", "11"])]]
        second = client.responses.create(model="policy", input=follow, tools=tools)
        assert second.output_text == "7 and 11"
        [sample] = finish(adapter, "par-2")
        assert sample.reward == 1.0 and sum(sample.loss_mask) > len(tokenizer.encode("7 and 11"))
    finally:
        handle.stop()


# ---------------------------------------------------------------- the SGLang call retries a connection never made


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stand_in_generate(tokenizer, calls: list):
    """A /generate that answers "done" with log-probs (SGLang's shape), counting its calls."""
    from aiohttp import web

    async def generate(request):
        calls.append(await request.json())
        ids = tokenizer.encode("done" + tokenizer.eos_token, add_special_tokens=False)
        return web.json_response({"text": "done", "output_ids": ids, "meta_info": {
            "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, i, None] for i in ids]}})
    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


def test_a_generate_that_could_not_connect_is_retried_once(tokenizer, monkeypatch):
    import threading

    monkeypatch.setattr(common, "CONNECT_RETRY_SECONDS", 1.0)
    port = _free_port()
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url=f"http://127.0.0.1:{port}")
    handle = run_app_in_thread(adapter.app)
    calls, engines = [], []
    # the engine (a router restarting, say) comes up while the adapter waits to retry
    timer = threading.Timer(0.3, lambda: engines.append(run_app_in_thread(_stand_in_generate(tokenizer, calls),
                                                                          port=port)))
    timer.start()
    try:
        adapter.open_session("retry-1")
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="retry-1", max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "done" and len(calls) == 1
    finally:
        timer.join()
        for engine in engines:
            engine.stop()
        handle.stop()


def test_a_generate_that_never_connects_fails_after_one_retry(tokenizer, monkeypatch):
    monkeypatch.setattr(common, "CONNECT_RETRY_SECONDS", 0.05)
    attempts = []
    real = OpenAIAdapter.http_client

    def counting(self):
        attempts.append(1)
        return real(self)
    monkeypatch.setattr(OpenAIAdapter, "http_client", counting)
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url=f"http://127.0.0.1:{_free_port()}")
    handle = run_app_in_thread(adapter.app)
    try:
        adapter.open_session("retry-2")
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="retry-2", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert len(attempts) == 2
    finally:
        handle.stop()

"""The agent adapters driven by the official SDKs against the embedded engine serving a scripted model.

What a user of the adapters relies on: tool calls round-trip through each API's own shapes; a
session's samples hold exactly the rendered prompts and the sampled ids; loss masks cover exactly
the model's tokens; log-probs are the engine's, one per trained token; turns merge (or not) as
docs/INTERFACES.md §6.6 says; a malformed tool call is answered; strict mode refuses unknown sessions.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aiohttp import ClientSession, web

from agent_script import (ANTHROPIC_TOOLS, ASK_ADD, ASK_BAD, ASK_THINK, CHAT_TOOLS, ADD_DESCRIPTION, ADD_SCHEMA,
                      call_text, canonical_call, render_ids)
from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils.types import Sample

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.timeout(300)
GREEDY = {"temperature": 0.0, "max_new_tokens": 64}


@pytest.fixture
def serve(tokenizer, engine):
    """serve(cls, **kwargs) -> (adapter, handle); every server is stopped at the end of the test."""
    handles = []

    def start(cls=OpenAIAdapter, host="127.0.0.1", **kwargs):
        kwargs.setdefault("tool_parser", "qwen25")
        adapter = cls(tokenizer=tokenizer, sglang_url=kwargs.pop("sglang_url", engine.url), **kwargs)
        handle = run_app_in_thread(adapter.app, host=host)
        handles.append(handle)
        return adapter, handle

    yield start
    for handle in handles:
        handle.stop()


def finish(adapter, sid, **kwargs):
    kwargs.setdefault("base_sample", Sample(index=7, group_index=2, prompt="p", label="7"))
    return asyncio.run(adapter.finish_session(sid, **kwargs))


def engine_greedy(engine, prompt_ids, max_new_tokens=64):
    """The engine's own answer for these prompt ids (what the adapter must have recorded)."""
    out = httpx.post(f"{engine.url}/generate", timeout=60, json={
        "input_ids": prompt_ids, "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "no_stop_trim": True}}).json()
    triples = out["meta_info"]["output_token_logprobs"]
    return [t[1] for t in triples], [t[0] for t in triples]


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def expected_merged_add_session(tokenizer, engine):
    """Tokens, mask and log-probs of the two-turn add session, built from the chat template and the engine."""
    user = [{"role": "user", "content": ASK_ADD}]
    p1 = render_ids(tokenizer, user)
    p2 = render_ids(tokenizer, user + [canonical_call({"a": 3, "b": 4}), {"role": "tool", "content": "7"}])
    o1, lp1 = engine_greedy(engine, p1)
    o2, lp2 = engine_greedy(engine, p2)
    assert o1 == encode(tokenizer, call_text({"a": 3, "b": 4}) + "<|im_end|>") and o2 == encode(tokenizer, "7<|im_end|>")
    assert p2[:len(p1) + len(o1)] == p1 + o1, "the template must extend the sampled tokens for this session"
    glue = len(p2) - len(p1) - len(o1)
    return {"prompt_length": len(p1), "tokens": p2 + o2, "loss_mask": [1] * len(o1) + [0] * glue + [1] * len(o2),
            "log_probs": lp1 + [0.0] * glue + lp2}


def assert_sample_is(sample, expected, reward=1.0):
    assert sample.tokens == expected["tokens"]
    assert sample.response_length == len(expected["tokens"]) - expected["prompt_length"]
    assert sample.loss_mask == expected["loss_mask"]
    assert len(sample.rollout_log_probs) == len(sample.loss_mask)
    assert sample.rollout_log_probs == pytest.approx(expected["log_probs"], abs=1e-4)
    assert all(lp <= 0 for lp in sample.rollout_log_probs)
    assert sample.reward == reward and sample.rollout_id == 7 and sample.status == Sample.Status.COMPLETED
    assert sample.metadata["use_tool"] is True and sample.metadata["ill_formed"] is False


def test_openai_chat_tool_round_trip_is_one_exact_sample(serve, tokenizer, engine):
    adapter, handle = serve(OpenAIAdapter)
    adapter.open_session("chat-1", sampling_defaults=GREEDY)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="chat-1", max_retries=0)
    messages = [{"role": "user", "content": ASK_ADD}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 3, "b": 4}
    assert call.id.startswith("call_") and first.usage.prompt_tokens == len(render_ids(tokenizer, messages))

    messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS)
    assert second.choices[0].message.content == "7" and second.choices[0].finish_reason == "stop"

    samples = finish(adapter, "chat-1", reward=1.0, extra_metadata={"episode": "a"})
    assert len(samples) == 1
    expected = expected_merged_add_session(tokenizer, engine)
    assert_sample_is(samples[0], expected)
    assert samples[0].metadata["episode"] == "a" and samples[0].label == "7" and samples[0].index == 7
    assert samples[0].response == tokenizer.decode(expected["tokens"][expected["prompt_length"]:])
    assert finish(adapter, "chat-1") == []  # idempotent
    with pytest.raises(openai.APIStatusError) as closed:
        client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS)
    assert closed.value.status_code == 503


def test_openai_chat_streaming_carries_the_tool_call(serve):
    adapter, handle = serve(OpenAIAdapter)
    adapter.open_session("stream-1", sampling_defaults=GREEDY)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="stream-1", max_retries=0)
    stream = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": ASK_ADD}],
                                            tools=CHAT_TOOLS, stream=True)
    calls, finish_reason = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        calls += delta.tool_calls or []
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 3, "b": 4})]
    assert len(finish(adapter, "stream-1")) == 1


def test_responses_api_and_agents_sdk_give_the_same_sample(serve, tokenizer, engine):
    adapter, handle = serve(OpenAIAdapter)
    adapter.open_session("resp-1", sampling_defaults=GREEDY)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="resp-1", max_retries=0)
    response = client.responses.create(model="policy", input=ASK_ADD, tools=[
        {"type": "function", "name": "add", "description": ADD_DESCRIPTION, "parameters": ADD_SCHEMA, "strict": False}])
    [item] = [item for item in response.output if item.type == "function_call"]
    assert item.name == "add" and json.loads(item.arguments) == {"a": 3, "b": 4}
    assert len(finish(adapter, "resp-1")) == 1

    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    async def invoke(_ctx, arguments: str) -> str:
        calls.append(json.loads(arguments))
        args = json.loads(arguments)
        return str(args["a"] + args["b"])

    add = agents.FunctionTool(name="add", description=ADD_DESCRIPTION, params_json_schema=ADD_SCHEMA,
                              on_invoke_tool=invoke, strict_json_schema=False)
    adapter.open_session("agents-1", sampling_defaults=GREEDY)
    model = agents.OpenAIResponsesModel(model="policy", openai_client=openai.AsyncOpenAI(
        base_url=handle.url + "/v1", api_key="agents-1", max_retries=0))
    agent = agents.Agent(name="calc", instructions=None, tools=[add], model=model)
    result = asyncio.run(agents.Runner.run(agent, ASK_ADD))
    assert calls == [{"a": 3, "b": 4}] and result.final_output == "7"
    samples = finish(adapter, "agents-1", reward=1.0)
    assert len(samples) == 1
    assert_sample_is(samples[0], expected_merged_add_session(tokenizer, engine))


def test_anthropic_messages_tool_use_round_trip(serve, tokenizer, engine):
    adapter, handle = serve(AnthropicAdapter)
    adapter.open_session("claude-1", sampling_defaults=GREEDY)
    client = anthropic.Anthropic(base_url=handle.url, api_key="claude-1", max_retries=0)
    messages = [{"role": "user", "content": ASK_ADD}]
    first = client.messages.create(model="policy", max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS)
    assert first.stop_reason == "tool_use"
    [tool_use] = [block for block in first.content if block.type == "tool_use"]
    assert tool_use.name == "add" and tool_use.input == {"a": 3, "b": 4} and tool_use.id.startswith("toolu_")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "7"}]}]
    with client.messages.stream(model="policy", max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text == "7"
    count = client.messages.count_tokens(model="policy", messages=messages[:1], tools=ANTHROPIC_TOOLS)
    assert count.input_tokens == len(render_ids(tokenizer, messages[:1]))

    samples = finish(adapter, "claude-1", reward=1.0)
    assert len(samples) == 1
    assert_sample_is(samples[0], expected_merged_add_session(tokenizer, engine))


def _reasoning_session(serve, **adapter_kwargs):
    adapter, handle = serve(OpenAIAdapter, reasoning_parser="qwen3", **adapter_kwargs)
    adapter.open_session("think-1", sampling_defaults=GREEDY)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="think-1", max_retries=0)
    messages = [{"role": "user", "content": ASK_THINK}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS)
    message = first.choices[0].message
    assert message.model_extra["reasoning_content"] == "use add"
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 5, "b": 6}
    messages += [{"role": "assistant", "content": None, "tool_calls": [message.tool_calls[0].model_dump()]},
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "11"}]
    client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS, max_tokens=3)
    return adapter, finish(adapter, "think-1", reward=0.5)


def test_reasoning_dropped_by_the_template_forks_into_two_samples(serve, tokenizer, engine):
    _, samples = _reasoning_session(serve, fork_threshold_tokens=0)
    user = [{"role": "user", "content": ASK_THINK}]
    p1 = render_ids(tokenizer, user)
    p2 = render_ids(tokenizer, user + [canonical_call({"a": 5, "b": 6}), {"role": "tool", "content": "11"}])
    o1, lp1 = engine_greedy(engine, p1)
    o2, lp2 = engine_greedy(engine, p2, max_new_tokens=3)
    assert p2[:len(p1) + len(o1)] != p1 + o1  # the re-rendered history lost the think block
    assert [s.tokens for s in samples] == [p1 + o1, p2 + o2]
    assert [s.loss_mask for s in samples] == [[1] * len(o1), [1] * len(o2)]
    assert samples[0].rollout_log_probs == pytest.approx(lp1, abs=1e-4)
    assert samples[1].rollout_log_probs == pytest.approx(lp2, abs=1e-4)
    assert {s.rollout_id for s in samples} == {7} and {s.reward for s in samples} == {0.5}


def test_reasoning_dropped_by_the_template_realigns_by_default(serve, tokenizer, engine):
    _, samples = _reasoning_session(serve)
    user = [{"role": "user", "content": ASK_THINK}]
    p1 = render_ids(tokenizer, user)
    p2 = render_ids(tokenizer, user + [canonical_call({"a": 5, "b": 6}), {"role": "tool", "content": "11"}])
    o2, lp2 = engine_greedy(engine, p2, max_new_tokens=3)
    [sample] = samples  # the short first reply is replaced by its re-rendering, no longer trained
    assert sample.tokens == p2 + o2
    assert sample.loss_mask == [0] * (len(p2) - len(p1)) + [1] * len(o2)
    assert sample.rollout_log_probs == pytest.approx([0.0] * (len(p2) - len(p1)) + lp2, abs=1e-4)


def test_malformed_tool_arguments_are_answered_not_raised(serve):
    adapter, handle = serve(OpenAIAdapter)
    adapter.open_session("bad-1", sampling_defaults=GREEDY)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="bad-1", max_retries=0)
    messages = [{"role": "user", "content": ASK_BAD}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) == {"_raw_arguments": "two and three"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "error: arguments must be a JSON object"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=CHAT_TOOLS, max_tokens=3)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    samples = finish(adapter, "bad-1")
    assert samples and samples[0].metadata["ill_formed"] is True


def test_context_budget_and_turn_cap(serve, tokenizer):
    adapter, handle = serve(OpenAIAdapter, max_turns_per_sid=1)
    prompt_length = len(render_ids(tokenizer, [{"role": "user", "content": ASK_ADD}]))
    adapter.open_session("budget-1", sampling_defaults=GREEDY, max_context_tokens=prompt_length + 4)
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="budget-1", max_retries=0)
    first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": ASK_ADD}],
                                           tools=CHAT_TOOLS)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 4
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": ASK_ADD}], tools=CHAT_TOOLS)
    [sample] = finish(adapter, "budget-1")
    assert len(sample.tokens) == prompt_length + 4 and sample.metadata["truncated"] is True


def test_strict_mode_serves_only_opened_sessions(serve):
    adapter, handle = serve(OpenAIAdapter, host="0.0.0.0")  # any non-loopback bind turns strict mode on
    assert adapter.strict
    url = f"http://127.0.0.1:{handle.port}"
    adapter.open_session("opened-1", sampling_defaults=GREEDY)
    body = {"model": "policy", "messages": [{"role": "user", "content": ASK_ADD}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401  # no session id
    unknown = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer guess"})
    assert unknown.status_code == 401 and "strict mode" in unknown.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="default", max_retries=0).chat.completions.create(**body)
    ok = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer opened-1"})
    assert ok.status_code == 200
    assert "default" not in adapter.store and "guess" not in adapter.store

    claude, claude_handle = serve(AnthropicAdapter, strict=True)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=claude_handle.url, api_key="guess", max_retries=0).messages.create(
            model="policy", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_loopback_adapter_serves_implicit_sessions(serve):
    adapter, handle = serve(OpenAIAdapter)
    assert not adapter.strict
    body = {"model": "policy", "messages": [{"role": "user", "content": ASK_ADD}], "max_tokens": 2}
    assert httpx.post(handle.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer implicit-1"}).status_code == 200
    assert adapter.turn_counts["implicit-1"] == 1 and not adapter.store["implicit-1"].opened


def test_session_id_is_the_routing_key(serve, engine):
    """Every /generate carries X-SMG-Routing-Key: <sid> (a recording proxy sits in front of the engine)."""
    seen = []

    async def forward(request: web.Request) -> web.Response:
        seen.append(request.headers.get("X-SMG-Routing-Key"))
        async with ClientSession() as session:
            async with session.post(engine.url + "/generate", data=await request.read(),
                                    headers={"Content-Type": "application/json"}) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

    proxy_app = web.Application()
    proxy_app.router.add_post("/generate", forward)
    proxy = run_app_in_thread(proxy_app)
    try:
        adapter, handle = serve(AnthropicAdapter, sglang_url=proxy.url)
        adapter.open_session("route-1", sampling_defaults=GREEDY)
        anthropic.Anthropic(base_url=handle.url, api_key="route-1", max_retries=0).messages.create(
            model="policy", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    finally:
        proxy.stop()
    assert seen == ["route-1"]


def test_adapters_importable_under_upstreams_module_names():
    from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
    from slime.agent.adapters.anthropic import AnthropicAdapter as UpstreamAnthropic
    from slime.agent.adapters.openai import OpenAIAdapter as UpstreamOpenAI

    assert UpstreamOpenAI is OpenAIAdapter and UpstreamAnthropic is AnthropicAdapter

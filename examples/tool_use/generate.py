"""Custom generate function of the tool-use example (``--custom-generate-function-path
examples.tool_use.generate.generate``): an agent loop, written against the official ``openai``
client, that the OpenAI adapter turns into exact-token training samples.

Per slot: open an adapter session (id = API key; slime's sampling params as defaults, the context
budget from ``--rollout-max-context-len``), run the agent — ask the model, execute each tool call
with the thermometer, answer the model, until it replies without a tool call or ``MAX_TURNS`` is
reached — then ``finish_session`` returns the session's samples (a fan-out list sharing one
``rollout_id``). The reward is left to ``--custom-rm-path examples.tool_use.reward.reward``, which
reads the episode summary stored in each sample's metadata. In evaluation one sample per episode is
returned, so ``eval/<name>`` is a per-episode mean reward.

One adapter per rollout process, served on 127.0.0.1 on a thread of its own and pointed at slime's
router (tool-call parser from ``--sglang-tool-call-parser``, default ``qwen25``).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import uuid

from slime.agent.adapters import OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.trajectory import failed_episode
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

MAX_TURNS = 3
_servers: dict[int, tuple] = {}  # id(args) -> (adapter, handle, args): one adapter per process and config
_servers_lock = threading.Lock()


def agent_server(args) -> tuple[OpenAIAdapter, str]:
    """The process's adapter for this ``args`` object and its base URL (started on first use)."""
    with _servers_lock:
        entry = _servers.get(id(args))
        if entry is None or entry[2] is not args:
            if getattr(args, "sglang_tool_call_parser", None) is None:
                args.sglang_tool_call_parser = "qwen25"
            adapter = OpenAIAdapter.from_args(args)
            entry = (adapter, run_app_in_thread(adapter.app, thread_name="tool-use-adapter"), args)
            _servers[id(args)] = entry
        return entry[0], entry[1].url


def run_tool(name: str, arguments: str, temperature: str) -> tuple[str, dict | None]:
    """The thermometer: ``(answer for the model, parsed arguments or None when not JSON)``."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if name != "get_temperature":
        return f"error: unknown tool {name!r}; the only tool is get_temperature", parsed
    if not isinstance(parsed, dict):
        return "error: the arguments of get_temperature must be a JSON object, e.g. {}", parsed
    return temperature, parsed


async def run_episode(client, messages: list[dict], tools: list[dict], call_tool) -> dict:
    """The agent: plain OpenAI Chat Completions with tools; ``await call_tool(name, arguments)`` runs a
    call and returns ``(answer for the model, parsed arguments)``. Returns the episode summary."""
    tool_calls, final_answer, turns = [], None, 0
    for _ in range(MAX_TURNS):
        turns += 1
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        if not message.tool_calls:
            final_answer = message.content or ""
            break
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [call.model_dump() for call in message.tool_calls]})
        for call in message.tool_calls:
            answer, parsed = await call_tool(call.function.name, call.function.arguments)
            tool_calls.append({"name": call.function.name, "arguments": parsed, "result": answer})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return {"final_answer": final_answer, "tool_calls": tool_calls, "turns": turns}


async def play_episode(args, sample: Sample, sampling_params: dict, call_tool, evaluation: bool = False,
                       name: str = "tool-use"):
    """One adapter session around :func:`run_episode`: the episode's samples (one in evaluation), or
    a removed placeholder when the episode broke."""
    import openai

    adapter, url = agent_server(args)
    sid = f"{name}-{sample.index}-{uuid.uuid4().hex}"
    sample.session_id = sid
    adapter.open_session(sid, sampling_defaults=sampling_params,
                         max_context_tokens=getattr(args, "rollout_max_context_len", None) or 0)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=sid, max_retries=0)
    samples = None
    try:
        episode = await run_episode(client, copy.deepcopy(sample.prompt), sample.metadata.get("tools") or [], call_tool)
        samples = await adapter.finish_session(sid, base_sample=sample, reward=None, extra_metadata=episode)
    except Exception as e:  # an episode that breaks is dropped from training, the run goes on
        logger.error("%s episode of sample %s failed: %s: %s", name, sample.index, type(e).__name__, e)
        return failed_episode(sample, f"{type(e).__name__}: {e}")
    finally:
        if samples is None:  # failed or cancelled: release the session and its in-flight turns
            await adapter.drop_session(sid, wait_timeout=0)
        await client.close()
    if not samples:
        return failed_episode(sample, "the session recorded no trainable turn")
    return samples[0] if evaluation else samples


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False):
    temperature = str(sample.metadata.get("temperature"))

    async def thermometer(name: str, arguments: str):
        return run_tool(name, arguments, temperature)

    return await play_episode(args, sample, sampling_params, thermometer, evaluation=evaluation)

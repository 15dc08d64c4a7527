"""The OpenEnv generate function (``--custom-generate-function-path slime.agent.openenv.generate``).

Per rollout slot: open a session on slime's OpenAI adapter (its id is the API key; slime's sampling
params as defaults, ``--rollout-max-context-len`` as the budget) and an episode on the row's OpenEnv
server (``reset`` with the row's ``task_id``). Then, turn after turn up to the row's ``max_turns``:

* the model answers through the adapter, which records the exact sampled tokens;
* its tool call (read with ``--sglang-tool-call-parser``) runs on the episode, and the answer goes
  back as a tool message; arguments that are not a JSON object, or a tool the row does not offer,
  are answered to the model with why, and not sent to the env;
* a reply without a tool call ends the turn: ``end_turn`` with the reply; the env answers with the
  next prompt (a new user message) or with ``done`` and a reward.

``finish_session`` turns the recorded turns into samples that all carry the env's score, so no
reward model is called. An episode the env broke (unreachable past ``reset_timeout``, a failed
control call, a lost session) returns a removed placeholder flagged ``metadata["openenv_failure"]``;
with ``--dynamic-sampling-filter-path slime.agent.openenv.keep_scored_groups`` its whole group is
left out and slime draws another. The episode is always torn down. In evaluation one sample per
episode is returned, so ``eval/<name>`` is a per-episode mean.

Rows (JSON Lines, ``--input-key messages --metadata-key metadata``)::

    {"messages": [{"role": "user", "content": "..."}],
     "metadata": {"split": "train", "index": 0, "task_id": "t-0", "max_turns": 4,
                  "tools": ["get_temperature"],                 # optional: offer only these env tools
                  "server": {"url": "http://127.0.0.1:8000", "transport": "ws", "reset_timeout": 60,
                             "token_env": "MY_ENV_TOKEN"}}}

``metadata.server`` may be left out when ``--custom-config-path`` sets ``openenv_server`` (same keys).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import uuid

from slime.agent.openenv.session import (
    END_TURN,
    HARNESS_TOOLS,
    EnvFailure,
    EnvSettings,
    episode_for,
    turn_outcome,
)
from slime.utils.misc import custom_config_value
from slime.utils.passthrough import sglang_value
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_MAX_TURNS = 8
_adapters: dict[int, tuple] = {}  # id(args) -> (adapter, app handle, args): one adapter per process and config
_adapters_lock = threading.Lock()


def agent_server(args):
    """The process's OpenAI adapter for this ``args`` (served on 127.0.0.1) and its base URL."""
    from slime.agent.adapters import OpenAIAdapter
    from slime.agent.aiohttp_threaded import run_app_in_thread

    with _adapters_lock:
        entry = _adapters.get(id(args))
        if entry is None or entry[2] is not args:
            if not sglang_value(args, "sglang_tool_call_parser"):
                raise ValueError("slime.agent.openenv.generate reads the model's tool calls with "
                                 "--sglang-tool-call-parser (e.g. qwen25); it is not set")
            adapter = OpenAIAdapter.from_args(args, strict=True)
            entry = (adapter, run_app_in_thread(adapter.app, thread_name="openenv-adapter"), args)
            _adapters[id(args)] = entry
        return entry[0], entry[1].url


def model_tools(env_tools: list[dict], offered: list | None) -> list[dict]:
    """The env's MCP tools as OpenAI function tools, less the harness's own and those the row leaves out."""
    names = None
    if offered is not None:
        names = {t if isinstance(t, str) else (t.get("function") or t).get("name") for t in offered}
    tools = []
    for tool in env_tools:
        name = tool.get("name")
        if not name or name in HARNESS_TOOLS or (names is not None and name not in names):
            continue
        tools.append({"type": "function", "function": {
            "name": name, "description": tool.get("description") or "",
            "parameters": tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}}})
    return tools


def call_arguments(name: str, raw: str | None, tool_names: set[str]) -> tuple[dict | None, str | None]:
    """``(arguments, None)`` for a well-formed call, or ``(None, what to tell the model)``."""
    if name not in tool_names:
        return None, f"error: unknown tool {name!r}; the tools are: {', '.join(sorted(tool_names)) or 'none'}"
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        value = raw
    if isinstance(value, dict) and set(value) == {"_raw_arguments"}:  # the adapter's mark for unparsable ones
        value = value["_raw_arguments"]
        try:
            value = json.loads(value)
        except (TypeError, json.JSONDecodeError):
            pass
    if not isinstance(value, dict):
        got = json.dumps(value) if not isinstance(value, str) else repr(value)
        return None, (f"error: the arguments of {name} must be a JSON object of its parameters, "
                      f"e.g. {{\"key\": value}}; got {got[:200]}")
    return value, None


async def _chat(http, messages: list[dict], tools: list[dict]) -> dict:
    response = await http.post("/v1/chat/completions", json={"model": "policy", "messages": messages,
                                                            "tools": tools or None})
    if response.status_code >= 400:
        raise RuntimeError(f"the adapter answered HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]


async def run_episode(http, episode, messages: list[dict], metadata: dict, reset_kwargs: dict) -> dict:
    """Play one episode; returns its summary (reward, turns, calls). Raises EnvFailure if the env breaks."""
    opening = await episode.open(reset_kwargs)
    if opening:
        messages.append({"role": "user", "content": opening})
    tools = model_tools(await episode.list_tools(), metadata.get("tools"))
    tool_names = {t["function"]["name"] for t in tools}
    max_turns = int(metadata.get("max_turns") or DEFAULT_MAX_TURNS)
    summary = {"reward": 0.0, "done": False, "turns": 0, "tool_calls": 0, "invalid_calls": 0, "env_turns": 0}
    while summary["turns"] < max_turns:
        summary["turns"] += 1
        choice = await _chat(http, messages, tools)
        message = choice["message"]
        calls = message.get("tool_calls") or []
        if calls:
            messages.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls})
            for call in calls:
                name = call["function"]["name"]
                arguments, problem = call_arguments(name, call["function"].get("arguments"), tool_names)
                if problem is not None:
                    summary["invalid_calls"] += 1
                    text = problem
                else:
                    summary["tool_calls"] += 1
                    answer = await episode.call_tool(name, arguments)
                    text = f"error: {answer.text}" if answer.is_error else answer.text
                messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": text})
            continue
        reply = message.get("content") or ""
        messages.append({"role": "assistant", "content": reply})
        done, reward, prompt = turn_outcome(await episode.call_tool(END_TURN, {"response": reply}))
        summary["env_turns"] += 1
        if done:
            summary.update(done=True, reward=float(reward or 0.0))
            break
        if choice.get("finish_reason") == "length":  # out of context budget: nothing more can be said
            break
        messages.append({"role": "user", "content": prompt or "Continue."})
    return summary


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False):
    import httpx

    metadata = sample.metadata or {}
    settings = EnvSettings.from_metadata(metadata, custom_config_value(args, "openenv_server"))
    reset_kwargs = {**settings.reset_kwargs, "task_id": metadata.get("task_id"),
                    "episode_id": f"{metadata.get('task_id')}-{uuid.uuid4().hex[:12]}"}
    if metadata.get("seed") is not None:
        reset_kwargs["seed"] = int(metadata["seed"])
    adapter, url = agent_server(args)
    sid = f"openenv-{sample.index}-{uuid.uuid4().hex}"
    sample.session_id = sid
    adapter.open_session(sid, sampling_defaults=sampling_params,
                         max_context_tokens=args.rollout_max_context_len or 0)
    episode = episode_for(settings)
    http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {sid}"}, timeout=None, trust_env=False)
    samples, started = None, time.monotonic()
    try:
        try:
            summary = await run_episode(http, episode, copy.deepcopy(sample.prompt), metadata, reset_kwargs)
        except EnvFailure as e:
            logger.warning("openenv episode of sample %s (task %s) failed: %s", sample.index,
                           metadata.get("task_id"), e)
            return failed_placeholder(sample, f"env: {e}")
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:  # adapter or engine trouble
            logger.error("openenv episode of sample %s failed: %s: %s", sample.index, type(e).__name__, e)
            return failed_placeholder(sample, f"{type(e).__name__}: {e}")
        finally:
            await episode.close()  # the episode is torn down whatever happened
        extra = {"openenv_reward": summary["reward"], "openenv_done": summary["done"],
                 "openenv_turns": summary["turns"], "openenv_tool_calls": summary["tool_calls"],
                 "openenv_invalid_calls": summary["invalid_calls"], "openenv_failure": None,
                 "task_id": metadata.get("task_id"), "split": metadata.get("split"),
                 "openenv_seconds": round(time.monotonic() - started, 3)}
        samples = await adapter.finish_session(sid, base_sample=sample, reward=summary["reward"], extra_metadata=extra)
    finally:
        if samples is None:  # failed or cancelled: release the session and its in-flight turns
            await adapter.drop_session(sid, wait_timeout=0)
        await http.aclose()
    if not samples:
        return failed_placeholder(sample, "the session recorded no trainable turn")
    return samples[0] if evaluation else samples


generate.abort_mode = "request"  # a rollout abort cancels the episode (its session is dropped, env closed)


def failed_placeholder(sample: Sample, reason: str) -> Sample:
    """A failed episode's slot (docs/INTERFACES.md §6.6): aborted, removed from training, reward 0, flagged."""
    from slime.agent.trajectory import failed_episode

    return failed_episode(sample, reason, openenv_failure=reason, openenv_reward=0.0)


def keep_scored_groups(args, samples, **kwargs):
    """Dynamic-sampling filter: leave out a group in which an episode failed (the env, not the model)."""
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    def leaves(x):
        return [s for item in x for s in leaves(item)] if isinstance(x, list) else [x]

    if any((s.metadata or {}).get("openenv_failure") for s in leaves(samples)):
        return DynamicFilterOutput(keep=False, reason="env_failed")
    return DynamicFilterOutput(keep=True)

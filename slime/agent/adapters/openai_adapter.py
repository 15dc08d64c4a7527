"""OpenAI-compatible adapter: Chat Completions (``/v1/chat/completions``) and Responses (``/v1/responses``).

Wire shapes follow the OpenAI API: a chat reply is ``{"role": "assistant", "content": text | null,
"tool_calls": [...]}`` with ``finish_reason`` ``tool_calls`` / ``length`` / ``stop``; a Responses
reply is a list of output items (``message`` with ``output_text``, ``function_call``). Only the first
parsed tool call is returned (the canonical echo the trajectory expects back) unless the adapter is built with
``preserve_parallel_tool_calls=True``: then every call the model made is returned, recorded and expected back
(for clients that run parallel calls, e.g. the OpenAI Agents SDK or Codex), and reasoning is sent
(``reasoning_content``) but not expected back: OpenAI clients strip it when echoing history, while
its tokens stay in the trained ids. Streaming replays a fully generated turn as
``chat.completion.chunk`` events (Chat Completions) or ``response.*`` events (Responses).
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from slime.agent.adapters.common import (BaseAdapter, HTTPProblem, Reply, canonical_assistant, canonical_tool_call,
                                         content_with_images, flatten_content, function_tool, new_id)
from slime.agent.parsing import arguments_dict


def translate_openai_tools(tools) -> list[dict]:
    """OpenAI function tools (nested ``function`` or the flat Responses form) → chat-template schema."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise HTTPProblem(400, "invalid_request_error", f"'tools' must be a list, got {type(tools).__name__}")
    schema = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise HTTPProblem(400, "invalid_request_error", f"tools[{i}] must be an object")
        if tool.get("type", "function") != "function":
            continue  # built-in tools (web search, ...) have no meaning for a local policy
        spec = tool.get("function", tool)
        schema.append(function_tool(spec.get("name"), spec.get("description"), spec.get("parameters")))
    return schema


def _assistant_from_chat(message: dict) -> dict:
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise HTTPProblem(400, "invalid_request_error", f"assistant tool_calls[{i}] needs function.name")
        calls.append(canonical_tool_call(function["name"], arguments_dict(function.get("arguments", {}))[0]))
    return canonical_assistant(flatten_content(message.get("content")), calls,
                               message.get("reasoning_content") or None)


def translate_chat(body: dict) -> tuple[list[dict], list[dict]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPProblem(400, "invalid_request_error", "'messages' must be a non-empty list")
    translated = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise HTTPProblem(400, "invalid_request_error", f"messages[{i}] must be an object")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role == "system":
            translated.append({"role": role, "content": flatten_content(message.get("content"))})
        elif role in ("user", "tool"):  # images kept as parts for the chat template and the processor
            translated.append({"role": role, "content": content_with_images(message.get("content"))})
        elif role == "assistant":
            translated.append(_assistant_from_chat(message))
    return translated, translate_openai_tools(body.get("tools"))


def translate_responses(body: dict) -> tuple[list[dict], list[dict]]:
    """Responses ``instructions`` + ``input`` items → messages; consecutive assistant-side items (output
    messages, function calls) form one assistant message. Reasoning items are dropped (see module doc)."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise HTTPProblem(400, "invalid_request_error", "'input' must be a string or a non-empty list of items")
    translated = []
    if body.get("instructions"):
        translated.append({"role": "system", "content": flatten_content(body["instructions"])})
    assistant = None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise HTTPProblem(400, "invalid_request_error", f"input[{i}] must be an object")
        kind = item.get("type") or "message"
        if kind == "message" and item.get("role") == "assistant" or kind == "function_call":
            if assistant is None:
                assistant = canonical_assistant("")
                translated.append(assistant)
            if kind == "message":
                text = flatten_content(item.get("content"))
                assistant["content"] = assistant["content"] + ("\n" if assistant["content"] and text else "") + text
            else:
                if not isinstance(item.get("name"), str):
                    raise HTTPProblem(400, "invalid_request_error", f"input[{i}] function_call needs a 'name'")
                call = canonical_tool_call(item["name"], arguments_dict(item.get("arguments", {}))[0])
                assistant.setdefault("tool_calls", []).append(call)
            continue
        if kind == "reasoning":
            continue
        assistant = None
        if kind == "function_call_output":
            translated.append({"role": "tool", "content": content_with_images(item.get("output"))})
        elif kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role in ("system", "user"):
                content = item.get("content")
                translated.append({"role": role, "content": content_with_images(content) if role == "user"
                                   else flatten_content(content)})
    return translated, translate_openai_tools(body.get("tools"))


class OpenAIAdapter(BaseAdapter):
    max_tokens_keys = ("max_completion_tokens", "max_tokens", "max_output_tokens")
    stop_key = "stop"

    def __init__(self, *, preserve_parallel_tool_calls: bool = False, **kwargs):
        """``preserve_parallel_tool_calls``: answer with every tool call a turn parsed (default: the first)."""
        super().__init__(**kwargs)
        self.preserve_parallel_tool_calls = bool(preserve_parallel_tool_calls)

    def _calls(self, parsed) -> list[dict]:
        return list(parsed.tool_uses) if self.preserve_parallel_tool_calls else parsed.tool_uses[:1]

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/chat/completions", self.handler(translate_chat, self._build_reply, self._write_chat))
        router.add_post("/v1/responses", self.handler(translate_responses, self._build_responses_reply,
                                                      self._write_responses))

    def session_id_from(self, request: web.Request, body: dict) -> str | None:
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        for candidate in (self.bearer_token(request), metadata.get("session_id"), body.get("user")):
            if isinstance(candidate, str) and candidate:
                return candidate
        return None

    def error_body(self, status: int, kind: str, message: str) -> dict:
        return {"error": {"message": message, "type": kind, "code": status}}

    def _translate(self, body: dict) -> tuple[list[dict], list[dict]]:
        return translate_chat(body)

    # ------------------------------------------------------------------ Chat Completions

    @staticmethod
    def _finish_reason(parsed, turn) -> str:
        if parsed.tool_uses:
            return "tool_calls"
        return "length" if turn.finish_reason == "length" else "stop"

    def _build_reply(self, parsed, turn, messages, tools, body) -> Reply:
        calls = self._calls(parsed)
        wire = {"role": "assistant", "content": None if calls else parsed.text}
        if parsed.reasoning:
            wire["reasoning_content"] = parsed.reasoning
        if calls:
            wire["tool_calls"] = [{"id": new_id("call_"), "type": "function",
                                   "function": {"name": c["name"], "arguments": json.dumps(c["input"], sort_keys=True)}}
                                  for c in calls]
        manager = canonical_assistant("" if calls else parsed.text,
                                      [canonical_tool_call(c["name"], c["input"]) for c in calls])
        finish = self._finish_reason(parsed, turn)
        return Reply(manager_message=manager, finish_reason=finish, wire=(wire, finish))

    def _usage(self, turn) -> dict:
        return {"prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(turn.output_ids),
                "total_tokens": len(turn.prompt_ids) + len(turn.output_ids)}

    async def _write_chat(self, request, reply: Reply, body: dict, turn) -> web.StreamResponse:
        message, finish = reply.wire
        common = {"id": new_id("chatcmpl_"), "created": int(time.time()), "model": body.get("model") or self.model_name}
        if not self.wants_stream(request, body):
            return await self.send_json(request, {**common, "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}], "usage": self._usage(turn)})

        def chunk(delta, finish_reason=None, **extra):
            return None, {**common, "object": "chat.completion.chunk", **extra,
                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

        events = [chunk({"role": "assistant", "content": ""})]
        if message.get("reasoning_content"):
            events.append(chunk({"reasoning_content": message["reasoning_content"]}))
        if message.get("content"):
            events.append(chunk({"content": message["content"]}))
        if message.get("tool_calls"):
            events.append(chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}))
        events.append(chunk({}, finish, usage=self._usage(turn)))
        events.append((None, "[DONE]"))
        return await self.send_events(request, events)

    # ------------------------------------------------------------------ Responses

    def _build_responses_reply(self, parsed, turn, messages, tools, body) -> Reply:
        calls = self._calls(parsed)
        output = []
        if parsed.reasoning:
            output.append({"type": "reasoning", "id": new_id("rs_"), "status": "completed",
                           "summary": [{"type": "summary_text", "text": parsed.reasoning}]})
        if parsed.text or not calls:
            output.append({"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": parsed.text, "annotations": []}]})
        for call in calls:
            output.append({"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"),
                           "name": call["name"], "arguments": json.dumps(call["input"], sort_keys=True),
                           "status": "completed"})
        manager = canonical_assistant(parsed.text, [canonical_tool_call(c["name"], c["input"]) for c in calls])
        return Reply(manager_message=manager, finish_reason=self._finish_reason(parsed, turn), wire=output)

    async def _write_responses(self, request, reply: Reply, body: dict, turn) -> web.StreamResponse:
        incomplete = reply.finish_reason == "length"
        response = {
            "id": new_id("resp_"), "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "model": body.get("model") or self.model_name, "output": reply.wire,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.output_ids),
                      "total_tokens": len(turn.prompt_ids) + len(turn.output_ids),
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
        }
        if not self.wants_stream(request, body):
            return await self.send_json(request, response)
        events, sequence = [], 0

        def event(kind, **fields):
            nonlocal sequence
            events.append((kind, {"type": kind, "sequence_number": sequence, **fields}))
            sequence += 1

        event("response.created", response={**response, "status": "in_progress", "output": []})
        for index, item in enumerate(reply.wire):
            event("response.output_item.added", output_index=index, item=item)
            if item["type"] == "message":
                text = item["content"][0]["text"]
                event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                      delta=text, logprobs=[])
                event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text, logprobs=[])
            elif item["type"] == "function_call":
                event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                      delta=item["arguments"])
                event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      arguments=item["arguments"], name=item["name"])
            event("response.output_item.done", output_index=index, item=item)
        event("response.incomplete" if incomplete else "response.completed", response=response)
        return await self.send_events(request, events)

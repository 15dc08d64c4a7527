"""Anthropic-compatible adapter: the Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Replies are content blocks — optional ``thinking``, optional ``text``, one ``tool_use`` block per
parsed call (all calls kept) — with ``stop_reason`` ``tool_use`` / ``max_tokens`` / ``end_turn``.
Anthropic clients echo thinking blocks back, so the recorded assistant message keeps
``reasoning_content``. Streaming replays the generated turn as ``message_start``,
``content_block_*``, ``message_delta`` and ``message_stop`` events.
"""

from __future__ import annotations

import json

from aiohttp import web

from slime.agent.adapters.common import (BaseAdapter, HTTPProblem, Reply, canonical_assistant, canonical_tool_call,
                                         content_with_images, flatten_content, function_tool, new_id)


def fold_system_messages(body: dict) -> dict:
    """``system`` entries inside ``messages`` become a ``<system-reminder>`` text block of the previous
    user message (else the next one; with no user message at all, a user message of their own)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return body
    folded: list[dict] = []
    pending: list[dict] = []  # reminders waiting for the next user message
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "system":
            block = {"type": "text", "text": f"<system-reminder>\n{flatten_content(message.get('content'))}\n"
                                             f"</system-reminder>\n"}
            target = next((m for m in reversed(folded) if m.get("role") == "user"), None)
            if target is not None:
                target["content"] = _blocks(target.get("content")) + [block]
            else:
                pending.append(block)
            continue
        message = dict(message)
        if pending and message.get("role") == "user":
            message["content"] = pending + _blocks(message.get("content"))
            pending = []
        folded.append(message)
    if pending:
        folded.append({"role": "user", "content": pending})
    return {**body, "messages": folded}


def _blocks(content) -> list:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def translate_anthropic_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise HTTPProblem(400, "invalid_request_error", f"'tools' must be a list, got {type(tools).__name__}")
    schema = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise HTTPProblem(400, "invalid_request_error", f"tools[{i}] must be an object")
        if "name" not in tool or tool.get("type") not in (None, "custom"):
            continue  # server tools (web_search_...) have no meaning for a local policy
        schema.append(function_tool(tool.get("name"), tool.get("description"),
                                    tool.get("input_schema") or tool.get("parameters")))
    return schema


def translate_messages(body: dict) -> tuple[list[dict], list[dict]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPProblem(400, "invalid_request_error", "'messages' must be a non-empty list")
    translated = []
    system = flatten_content(body.get("system"))
    if system:
        translated.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise HTTPProblem(400, "invalid_request_error", f"messages[{i}] must have role 'user' or 'assistant'")
        content = message.get("content")
        if message["role"] == "assistant":
            translated.append(_assistant_from_blocks(_blocks(content), i))
            continue
        user_blocks: list = []  # images kept as parts for the chat template and the processor
        for block in _blocks(content):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                if user_blocks:
                    translated.append({"role": "user", "content": content_with_images(user_blocks)})
                    user_blocks = []
                translated.append({"role": "tool", "content": content_with_images(block.get("content"))})
            else:
                user_blocks.append(block)
        if user_blocks or not content:
            translated.append({"role": "user", "content": content_with_images(user_blocks)})
    return translated, translate_anthropic_tools(body.get("tools"))


def _assistant_from_blocks(blocks: list, index: int) -> dict:
    texts, thinking, calls = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            thinking.append(block.get("thinking", ""))
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise HTTPProblem(400, "invalid_request_error", f"messages[{index}] tool_use block needs a 'name'")
            arguments = block.get("input") if isinstance(block.get("input"), dict) else {"_raw_arguments":
                                                                                        json.dumps(block.get("input"))}
            calls.append(canonical_tool_call(block["name"], arguments))
    return canonical_assistant("".join(texts), calls, "".join(thinking) or None)


class AnthropicAdapter(BaseAdapter):
    max_tokens_keys = ("max_tokens",)
    stop_key = "stop_sequences"

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", self.handler(self._translate, self._build_reply, self._write_message))
        router.add_post("/v1/messages/count_tokens", self._count_tokens)

    def session_id_from(self, request: web.Request, body: dict) -> str | None:
        return self.bearer_token(request) or request.headers.get("X-Api-Key") or None

    def error_body(self, status: int, kind: str, message: str) -> dict:
        return {"type": "error", "error": {"type": kind, "message": message}}

    def _translate(self, body: dict) -> tuple[list[dict], list[dict]]:
        return translate_messages(fold_system_messages(body))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """The rendered prompt's length (the same rendering a turn would send)."""
        try:
            body = await self.read_json(request)
            messages, tools = self._translate(body)
            return web.json_response({"input_tokens": len(self.render(messages, tools))})
        except HTTPProblem as problem:
            return web.json_response(self.error_body(problem.status, problem.kind, problem.message),
                                     status=problem.status)

    def _build_reply(self, parsed, turn, messages, tools, body) -> Reply:
        content = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.text:
            content.append({"type": "text", "text": parsed.text})
        for call in parsed.tool_uses:
            content.append({"type": "tool_use", "id": new_id("toolu_", 16), "name": call["name"], "input": call["input"]})
        if not content:
            content.append({"type": "text", "text": ""})
        if parsed.tool_uses:
            stop_reason = "tool_use"
        else:
            stop_reason = "max_tokens" if turn.finish_reason == "length" else "end_turn"
        manager = canonical_assistant(parsed.text, [canonical_tool_call(c["name"], c["input"]) for c in parsed.tool_uses],
                                      parsed.reasoning or None)
        return Reply(manager_message=manager, finish_reason=stop_reason, wire=content)

    async def _write_message(self, request, reply: Reply, body: dict, turn) -> web.StreamResponse:
        message = {"id": new_id("msg_"), "type": "message", "role": "assistant",
                   "model": body.get("model") or self.model_name, "content": reply.wire,
                   "stop_reason": reply.finish_reason, "stop_sequence": None,
                   "usage": {"input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.output_ids)}}
        if not self.wants_stream(request, body):
            return await self.send_json(request, message)
        events = [("message_start", {"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "usage": {"input_tokens": len(turn.prompt_ids),
                                                                      "output_tokens": 0}}})]
        for index, block in enumerate(reply.wire):
            if block["type"] == "thinking":
                start, delta = {"type": "thinking", "thinking": ""}, {"type": "thinking_delta",
                                                                       "thinking": block["thinking"]}
            elif block["type"] == "text":
                start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
            else:
                start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": start}))
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            if block["type"] == "thinking":
                events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "signature_delta", "signature": ""}}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reply.finish_reason, "stop_sequence": None},
                                         "usage": {"output_tokens": len(turn.output_ids)}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return await self.send_events(request, events)

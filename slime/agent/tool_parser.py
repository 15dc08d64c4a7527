"""Tool-call parsers for model output text (reusable by the agent layer).

``qwen25``: Qwen2.5/Qwen3 style, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
blocks, any number, possibly after some normal content. ``hermes``: the same markup as written by
Hermes-format models (arguments may also arrive as a JSON string). A block whose JSON does not parse
is left in the content, not dropped, so the caller can show the model its mistake.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = ""

    def to_openai(self, index: int) -> dict:
        return {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "index": index, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str  # text outside the tool-call blocks (stripped)
    tool_calls: list[ToolCall]


class TaggedJsonToolParser:
    """``<tool_call>{json}</tool_call>`` blocks; subclasses set the tags."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self):
        self._pattern = re.compile(re.escape(self.start_tag) + r"(.*?)(?:" + re.escape(self.end_tag) + r"|$)", re.S)

    def has_tool_call(self, text: str) -> bool:
        return self.start_tag in text

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput:
        allowed = {t.get("function", t).get("name") for t in tools or []} or None
        calls, kept, position = [], [], 0
        for match in self._pattern.finditer(text):
            call = self._parse_block(match.group(1), allowed)
            kept.append(text[position:match.start()])
            if call is None:
                kept.append(match.group(0))
            else:
                calls.append(call)
            position = match.end()
        kept.append(text[position:])
        return ParsedOutput(content="".join(kept).strip(), tool_calls=calls)

    @staticmethod
    def _parse_block(body: str, allowed: set[str] | None) -> ToolCall | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if allowed is not None and obj["name"] not in allowed:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ToolCall(name=obj["name"], arguments=arguments)
        return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


class Qwen25ToolParser(TaggedJsonToolParser):
    pass


class HermesToolParser(TaggedJsonToolParser):
    pass


TOOL_PARSERS = {"qwen25": Qwen25ToolParser, "qwen": Qwen25ToolParser, "hermes": HermesToolParser}


def get_tool_parser(name: str) -> TaggedJsonToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()

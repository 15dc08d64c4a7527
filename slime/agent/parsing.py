"""Split one decoded model turn into reasoning, visible text and tool calls (docs/INTERFACES.md §6.4 step 7).

``parse_model_output(raw, *, tools_schema, tool_parser_name, reasoning_parser_name)`` is what both
adapters call on the decoded output ids (special tokens kept, trailing stop token removed):

* reasoning: SGLang's ``ReasoningParser`` when SGLang imports; otherwise the think-tag split every
  supported family uses (text before the first ``</think>``, a leading ``<think>`` dropped);
* tool calls: SGLang's ``FunctionCallParser`` when SGLang imports; otherwise slime's own
  ``<tool_call>{json}</tool_call>`` parsers (``qwen25``/``qwen``/``hermes``, shared with the
  embedded engine); then, if nothing was found, the XML form
  ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`` for known
  tool names (the ``qwen3_coder`` markup).

Tool-call arguments are always a dict. Arguments that are not a JSON object become
``{"_raw_arguments": <text>}`` and the turn is ``ill_formed``; so is a ``<tool_call>`` block that
could not be parsed at all (it stays in the visible text, so the agent sees what the model wrote).
Nothing here raises on model output: a bad turn is data for training, not a server error.
``parse_tool_uses`` and ``parse_xml_tool_uses`` are the tool-call half on its own.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from slime.agent.tool_parser import TOOL_PARSERS, get_tool_parser

logger = logging.getLogger(__name__)

# Reasoning parser names whose models write <think>...</think> (used when SGLang is absent).
THINK_TAG_REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "step3",
                               "minimax", "minimax-append-think")
# Tool parser names slime can serve without SGLang ("qwen3_coder" is the XML fallback form).
FALLBACK_TOOL_PARSERS = tuple(sorted(TOOL_PARSERS)) + ("qwen3_coder",)

_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


@dataclass
class ParsedModelOutput:
    reasoning: str = ""
    text: str = ""
    tool_uses: list[dict] = field(default_factory=list)  # [{"name": str, "input": dict}]
    ill_formed: bool = False


def sglang_available() -> bool:
    try:
        import sglang.srt.function_call.function_call_parser  # noqa: F401
    except Exception:  # not installed, or its compiled kernels missing on this machine
        return False
    return True


def check_parser_names(tool_parser_name: str | None, reasoning_parser_name: str | None) -> None:
    """Fail at adapter construction (not on the first turn) for a parser name nobody can serve."""
    if sglang_available():
        return  # SGLang validates its own names when it builds the parser
    if tool_parser_name and tool_parser_name not in FALLBACK_TOOL_PARSERS:
        raise ValueError(f"tool-call parser {tool_parser_name!r} needs SGLang installed; without it slime "
                         f"supports {list(FALLBACK_TOOL_PARSERS)} (--sglang-tool-call-parser)")
    if reasoning_parser_name and reasoning_parser_name not in THINK_TAG_REASONING_PARSERS:
        raise ValueError(f"reasoning parser {reasoning_parser_name!r} needs SGLang installed; without it slime "
                         f"supports {list(THINK_TAG_REASONING_PARSERS)} (--sglang-reasoning-parser)")


def parse_model_output(raw: str, *, tools_schema: list[dict] | None, tool_parser_name: str | None,
                       reasoning_parser_name: str | None) -> ParsedModelOutput:
    reasoning, text = split_reasoning(raw, reasoning_parser_name)
    text, tool_uses, ill_formed = parse_tool_uses(text, tools_schema, tool_parser_name)
    return ParsedModelOutput(reasoning=reasoning.strip(), text=text.strip(), tool_uses=tool_uses,
                             ill_formed=ill_formed)


def parse_tool_uses(body_text: str, tools_schema: list[dict] | None,
                    tool_parser_name: str | None) -> tuple[str, list[dict], bool]:
    """``(visible_text, tool_uses, ill_formed)`` of a turn's text after the reasoning: the named parser
    first (SGLang's when it imports, else slime's), then, if it found nothing, the XML fallback
    (:func:`parse_xml_tool_uses`). Each use is ``{"name", "input"}``; without a tools schema no text
    is a call."""
    text, tool_uses, ill_formed = body_text, [], False
    if tool_parser_name and tools_schema:
        text, tool_uses, ill_formed = _parse_tool_calls(text, tools_schema, tool_parser_name)
    if not tool_uses and tools_schema:
        text, tool_uses = parse_xml_tool_uses(text, tools_schema)
    if tools_schema and "<tool_call>" in text:
        ill_formed = True  # a call block the parsers could not read stays visible to the agent
    return text, tool_uses, ill_formed


def split_reasoning(raw: str, reasoning_parser_name: str | None) -> tuple[str, str]:
    if not reasoning_parser_name:
        return "", raw
    if sglang_available():
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        reasoning, text = ReasoningParser(model_type=reasoning_parser_name, stream_reasoning=False).parse_non_stream(raw)
        return reasoning or "", text or ""
    head, sep, tail = raw.partition("</think>")
    if not sep:
        return "", raw
    return head.replace("<think>", "", 1), tail


def arguments_dict(arguments) -> tuple[dict, bool]:
    """Tool-call arguments as a dict, and whether they were ill-formed (not a JSON object)."""
    if isinstance(arguments, dict):
        return arguments, False
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return {"_raw_arguments": arguments}, True
        if isinstance(value, dict):
            return value, False
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"_raw_arguments": raw}, True


def _parse_tool_calls(text: str, tools_schema: list[dict], parser_name: str) -> tuple[str, list[dict], bool]:
    if sglang_available():
        calls = _sglang_tool_calls(text, tools_schema, parser_name)
    elif parser_name in TOOL_PARSERS:
        parsed = get_tool_parser(parser_name).parse(text, tools_schema)
        calls = ([(c.name, c.arguments) for c in parsed.tool_calls], parsed.content)
    else:  # qwen3_coder without SGLang: the XML fallback below handles it
        return text, [], False
    pairs, text = calls
    tool_uses, ill_formed = [], False
    for name, arguments in pairs:
        args_dict, bad = arguments_dict(arguments)
        tool_uses.append({"name": name, "input": args_dict})
        ill_formed = ill_formed or bad
    return text, tool_uses, ill_formed


def _sglang_tool_calls(text: str, tools_schema: list[dict], parser_name: str) -> tuple[list[tuple[str, str]], str]:
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    tools = [Tool(type="function", function=Function(**t["function"])) for t in tools_schema]
    parser = FunctionCallParser(tools=tools, tool_call_parser=parser_name)
    if not parser.has_tool_call(text):
        return [], text
    normal_text, calls = parser.parse_non_stream(text)
    return [(call.name, call.parameters) for call in calls], normal_text or ""


def parse_xml_tool_uses(body_text: str, tools_schema: list[dict] | None) -> tuple[str, list[dict]]:
    """``(visible_text, tool_uses)``: the calls written as
    ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`` (the
    ``qwen3_coder`` markup) whose NAME is a tool of ``tools_schema``, taken out of the text. A value that
    is JSON is decoded (``5`` -> 5, ``["a"]`` -> list), anything else stays a string; a block naming an
    unknown tool stays in the text."""
    names = {t["function"]["name"] for t in tools_schema or []}
    tool_uses, kept, position = [], [], 0
    for match in _XML_CALL.finditer(body_text):
        if match.group(1) not in names:
            continue
        arguments = {}
        for key, value in _XML_PARAM.findall(match.group(2)):
            value = value.strip("\n")
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError:
                arguments[key] = value
        tool_uses.append({"name": match.group(1), "input": arguments})
        kept.append(body_text[position:match.start()])
        position = match.end()
    kept.append(body_text[position:])
    return "".join(kept), tool_uses

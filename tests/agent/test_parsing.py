"""parse_model_output, parse_tool_uses and parse_xml_tool_uses: tool calls, reasoning and ill-formed
arguments (docs/INTERFACES.md §6.4 step 7)."""

import pytest

from slime.agent.parsing import check_parser_names, parse_model_output, parse_tool_uses, parse_xml_tool_uses, sglang_available

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def parse(raw, tool_parser="qwen25", reasoning=None, tools=TOOLS):
    return parse_model_output(raw, tools_schema=tools, tool_parser_name=tool_parser, reasoning_parser_name=reasoning)


@pytest.mark.parametrize("parser", ["qwen25", "hermes"])
def test_json_tool_calls(parser):
    out = parse('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
                '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>', parser)
    assert out.text == "Sure." and not out.ill_formed
    assert out.tool_uses == [{"name": "add", "input": {"a": 1}}, {"name": "add", "input": {"a": 2}}]


def test_non_object_arguments_are_kept_raw_and_flagged():
    out = parse('<tool_call>\n{"name": "add", "arguments": "two and three"}\n</tool_call>')
    assert out.tool_uses == [{"name": "add", "input": {"_raw_arguments": "two and three"}}] and out.ill_formed
    broken = parse('<tool_call>\n{"name": "add", "arguments": {a: 1}\n</tool_call>')
    assert broken.tool_uses == [] and broken.ill_formed and "<tool_call>" in broken.text


def test_xml_fallback_and_unknown_tools():
    out = parse("<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=s>\nhi\n</parameter>\n"
                "</function>\n</tool_call>", tool_parser=None)
    assert out.tool_uses == [{"name": "add", "input": {"a": 3, "s": "hi"}}] and out.text == ""
    assert parse('<tool_call>{"name": "rm", "arguments": {}}</tool_call>').tool_uses == []
    assert parse('<tool_call>{"name": "add", "arguments": {}}</tool_call>', tools=None).tool_uses == []


def test_reasoning_split():
    out = parse("<think>\nplan\n</think>\n\nanswer", reasoning="qwen3")
    assert (out.reasoning, out.text) == ("plan", "answer")
    assert parse("no think", reasoning="qwen3").text == "no think"
    assert parse("<think>x</think>y").text == "<think>x</think>y"  # no reasoning parser: untouched


@pytest.mark.skipif(sglang_available(), reason="SGLang validates its own parser names")
def test_unknown_parser_names_fail_early():
    with pytest.raises(ValueError, match="--sglang-tool-call-parser"):
        check_parser_names("llama3", None)
    with pytest.raises(ValueError, match="--sglang-reasoning-parser"):
        check_parser_names(None, "gpt-oss")


XML_CALL = ("Let me add.\n<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=s>\nhi there\n"
            "</parameter>\n<parameter=xs>\n[1, 2]\n</parameter>\n</function>\n</tool_call>")


def test_parse_xml_tool_uses_takes_the_calls_of_known_tools_out_of_the_text():
    text, uses = parse_xml_tool_uses(XML_CALL, TOOLS)
    assert uses == [{"name": "add", "input": {"a": 3, "s": "hi there", "xs": [1, 2]}}]
    assert text == "Let me add.\n"
    unknown = XML_CALL.replace("function=add", "function=rm")
    assert parse_xml_tool_uses(unknown, TOOLS) == (unknown, [])  # not a tool of the schema: stays text
    assert parse_xml_tool_uses(XML_CALL, None) == (XML_CALL, [])
    two = XML_CALL + " and " + XML_CALL.replace("Let me add.\n", "")
    assert [u["name"] for u in parse_xml_tool_uses(two, TOOLS)[1]] == ["add", "add"]


def test_parse_tool_uses_tries_the_named_parser_then_the_xml_form():
    json_call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert parse_tool_uses("ok " + json_call, TOOLS, "qwen25") == ("ok", [{"name": "add", "input": {"a": 1}}], False)
    text, uses, ill_formed = parse_tool_uses(XML_CALL, TOOLS, "qwen25")  # the JSON parser finds nothing: XML
    assert uses == [{"name": "add", "input": {"a": 3, "s": "hi there", "xs": [1, 2]}}] and not ill_formed
    text, uses, ill_formed = parse_tool_uses('<tool_call>{"name": "add", "arguments": {a: 1}</tool_call>', TOOLS, "qwen25")
    assert uses == [] and ill_formed and "<tool_call>" in text
    assert parse_tool_uses(json_call, None, "qwen25") == (json_call, [], False)  # no tools: no calls

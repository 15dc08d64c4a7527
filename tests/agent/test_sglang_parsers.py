"""slime's parse_model_output with SGLang 0.5.23's real tool-call and reasoning parsers, on the same
model outputs the fallback parsers (no SGLang) see; both must find the same calls and reasoning."""

from __future__ import annotations

import json

import pytest

from parser_cases import (CALL, FALLBACK_REASONING_PARSERS, FALLBACK_TOOL_CALL_PARSERS, REASONING_OUTPUTS,
                          TOOL_CALL_OUTPUTS, parse_all)
from slime.agent.parsing import check_parser_names, sglang_available
from tests.backends.sglang_utils.sglang_env import run_module

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def with_sglang():
    done = run_module("tests.agent.sglang_parsers")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fallback():
    assert not sglang_available()  # this process is the CPU install: the fallback parsers answer
    return parse_all()


def test_sglangs_parsers_are_the_ones_used(with_sglang):
    assert with_sglang["sglang_available"] is True


@pytest.mark.parametrize("name", sorted(TOOL_CALL_OUTPUTS))
def test_sglang_tool_call_parser(with_sglang, name):
    result = with_sglang["tool_calls"][name]
    assert result.get("error") is None, result
    assert result["tool_uses"] == [CALL] and result["ill_formed"] is False
    assert result["text"] == "Let me check."


@pytest.mark.parametrize("name", FALLBACK_TOOL_CALL_PARSERS)
def test_fallback_tool_call_parser_agrees_with_sglang(with_sglang, fallback, name):
    assert fallback["tool_calls"][name] == with_sglang["tool_calls"][name]


@pytest.mark.parametrize("name", sorted(REASONING_OUTPUTS))
def test_sglang_reasoning_parser(with_sglang, name):
    _, reasoning, text = REASONING_OUTPUTS[name]
    assert with_sglang["reasoning"][name] == {"reasoning": reasoning, "text": text}


@pytest.mark.parametrize("name", FALLBACK_REASONING_PARSERS)
def test_fallback_reasoning_parser_agrees_with_sglang(with_sglang, fallback, name):
    assert fallback["reasoning"][name] == with_sglang["reasoning"][name]


def test_formats_without_a_fallback_are_refused_by_name():
    for name in sorted(set(TOOL_CALL_OUTPUTS) - set(FALLBACK_TOOL_CALL_PARSERS)):
        with pytest.raises(ValueError, match=f"tool-call parser '{name}' needs SGLang"):
            check_parser_names(name, None)
    with pytest.raises(ValueError, match="reasoning parser 'gpt-oss' needs SGLang"):
        check_parser_names(None, "gpt-oss")

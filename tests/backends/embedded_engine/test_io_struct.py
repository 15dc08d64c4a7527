"""``/generate`` body validation: a sampling param of the wrong JSON type is a 400 naming the field."""

from __future__ import annotations

from dataclasses import fields

import pytest

from slime.backends.embedded_engine.io_struct import RequestError, SamplingParams, parse_generate


def _parse(sampling_params):
    return parse_generate({"input_ids": [1, 2, 3], "sampling_params": sampling_params}, None, vocab_size=100,
                          context_length=512)


@pytest.mark.parametrize("name,value,expected", [
    ("max_new_tokens", "5", "an integer"), ("max_new_tokens", 5.0, "an integer"), ("max_new_tokens", True, "an integer"),
    ("min_new_tokens", "1", "an integer"), ("top_k", "3", "an integer"), ("n", "2", "an integer"),
    ("temperature", "1", "a number"), ("temperature", None, "a number"), ("top_p", "0.9", "a number"),
    ("min_p", [0.1], "a number"), ("ignore_eos", "yes", "true or false"), ("skip_special_tokens", 1, "true or false"),
    ("stop", 5, "a string or a list of strings"), ("stop", ["a", 1], "a string or a list of strings"),
    ("stop_token_ids", "x", "a list of integers"), ("stop_token_ids", [1, "2"], "a list of integers"),
    ("custom_params", "x", "an object"), ("sampling_seed", "7", "an integer"),
])
def test_wrong_type_is_a_400_naming_the_field(name, value, expected):
    with pytest.raises(RequestError) as info:
        _parse({name: value})
    assert info.value.status == 400
    assert info.value.message == f"sampling_params.{name} must be {expected}, got {value!r} ({type(value).__name__})"


def test_well_typed_values_and_unset_fields_still_parse():
    (request,), _ = _parse({"max_new_tokens": 4, "temperature": 0, "top_p": 1, "top_k": -1, "stop": ["\n"],
                            "stop_token_ids": [2], "ignore_eos": True, "min_p": 0.0, "custom_params": {"a": 1}})
    assert request.params.max_new_tokens == 4 and request.params.top_k > 1
    (request,), _ = _parse({"max_new_tokens": None, "top_k": None, "stop": None, "sampling_seed": None})
    assert request.params.max_new_tokens is None


def test_every_sampling_field_has_a_type_check():
    takes_strings = {"stop", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag"}
    for field in fields(SamplingParams):
        value = 12345 if field.name in takes_strings else "odd"
        with pytest.raises(RequestError, match=f"sampling_params.{field.name} must be"):
            _parse({field.name: value})

"""Model outputs in each family's tool-call / reasoning format, and what a correct parse yields.

Shared by ``test_sglang_parsers.py`` (slime's fallback parsers, in-process) and ``sglang_parsers.py``
(the same ``parse_model_output`` with SGLang's own parsers importable, in a subprocess)."""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
CALL = {"name": "get_weather", "input": {"city": "Paris", "days": 2}}

# parser name -> model output with one call to get_weather(city="Paris", days=2) after "Let me check."
TOOL_CALL_OUTPUTS = {
    "qwen25": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "qwen3_coder": ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
    "llama3": 'Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": 'Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
    "deepseekv3": ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "glm45": ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"),
    "kimi_k2": ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'),
}
# the fallback parsers slime has for these (without SGLang)
FALLBACK_TOOL_CALL_PARSERS = ("qwen25", "hermes", "qwen3_coder")

# parser name -> (model output, reasoning, visible text)
REASONING_OUTPUTS = {
    "qwen3": ("<think>\nParis is in France.\n</think>\n\nIt is sunny.", "Paris is in France.", "It is sunny."),
    "deepseek-r1": ("Paris is in France.\n</think>\n\nIt is sunny.", "Paris is in France.", "It is sunny."),
    "glm45": ("<think>Paris is in France.</think>It is sunny.", "Paris is in France.", "It is sunny."),
    "kimi": ("◁think▷Paris is in France.◁/think▷It is sunny.", "Paris is in France.", "It is sunny."),
    "gpt-oss": ("<|channel|>analysis<|message|>Paris is in France.<|end|><|start|>assistant<|channel|>final"
                "<|message|>It is sunny.", "Paris is in France.", "It is sunny."),
}
FALLBACK_REASONING_PARSERS = ("qwen3", "deepseek-r1", "glm45")


def parse_all():
    """Every case through ``parse_model_output``: {"tool_calls": {name: ...}, "reasoning": {name: ...}}."""
    from slime.agent.parsing import parse_model_output

    out = {"tool_calls": {}, "reasoning": {}}
    for name, raw in TOOL_CALL_OUTPUTS.items():
        try:
            parsed = parse_model_output(raw, tools_schema=TOOLS, tool_parser_name=name, reasoning_parser_name=None)
            out["tool_calls"][name] = {"text": parsed.text, "tool_uses": parsed.tool_uses,
                                       "ill_formed": parsed.ill_formed}
        except Exception as e:
            out["tool_calls"][name] = {"error": f"{type(e).__name__}: {e}"}
    for name, (raw, _, _) in REASONING_OUTPUTS.items():
        try:
            parsed = parse_model_output(raw, tools_schema=None, tool_parser_name=None, reasoning_parser_name=name)
            out["reasoning"][name] = {"reasoning": parsed.reasoning, "text": parsed.text}
        except Exception as e:
            out["reasoning"][name] = {"error": f"{type(e).__name__}: {e}"}
    return out

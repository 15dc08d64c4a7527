"""A compact tool preamble for the tiny model's chat template.

The Qwen-style template of :mod:`slime.utils.tiny_model` puts ~250 tokens of tool instructions and
JSON schemas in front of every conversation that has tools: 80% of each training sequence, on two
CPU cores, for a model of under a million parameters that must learn to find a 4-token question
behind it. This example's model keeps the same template for everything else (user/assistant/tool
turns, ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks, so the ``qwen25`` parser
reads its calls) and lists the tools in one line instead::

    <|im_start|>system
    Tools: add(a, b)<|im_end|>

    python -m examples.tool_use.template outputs/tool-use/model   # rewrites its chat template
"""

from __future__ import annotations

import argparse
from pathlib import Path

from slime.utils.tiny_model import CHAT_TEMPLATE

_QWEN_TOOLS_START = "{%- if tools %}"
_QWEN_TOOLS_END = "{%- elif messages[0].role == 'system' %}"
COMPACT_TOOLS_PREAMBLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}"
    "{%- for tool in tools %}{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- ' ' + fn.name + '(' + (fn.parameters.properties | list | join(', ')) + ')' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
)


def compact_template(template: str = CHAT_TEMPLATE) -> str:
    """``template`` with its tool preamble replaced by the one-line list."""
    start, end = template.find(_QWEN_TOOLS_START), template.find(_QWEN_TOOLS_END)
    if start != 0 or end < 0:
        raise ValueError("not the tiny model's chat template: its tool preamble was not found")
    return COMPACT_TOOLS_PREAMBLE + template[end:]


def install(model_dir: str | Path, chatml: bool = False) -> None:
    """Rewrite the chat template of the tokenizer saved in ``model_dir`` (``chatml``: replace it by the tiny
    model's, for a ChatML model whose own template renders no tools, e.g. SmolLM2-135M-Instruct)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if chatml and "<|im_start|>" not in tokenizer.get_vocab():
        raise ValueError(f"{model_dir}: --chatml needs a tokenizer with ChatML's <|im_start|> token")
    tokenizer.chat_template = compact_template(CHAT_TEMPLATE if chatml else tokenizer.chat_template or CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(model_dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a checkpoint built by slime.utils.tiny_model")
    parser.add_argument("--chatml", action="store_true",
                        help="replace the checkpoint's own template by the tiny model's ChatML one (SmolLM2's renders no tools)")
    args = parser.parse_args(argv)
    install(args.model_dir, chatml=args.chatml)


if __name__ == "__main__":
    main()

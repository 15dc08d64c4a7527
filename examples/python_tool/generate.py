"""Custom generate function of the Python-tool example (``--custom-generate-function-path
examples.python_tool.generate.generate``), in the style of ReTool: the model may write code, the code
runs in a sandboxed child process, its output goes back as the tool's answer, until the model
replies without a call (at most ``examples.tool_use.generate.MAX_TURNS`` model turns).

The problem's data (the row's ``metadata["x"]``) is defined in the sandbox before each snippet runs
(``examples.python_tool.task.prelude``): the model sees only the question, the code sees the list.

The episode goes through slime's OpenAI adapter like ``examples/tool_use`` (same adapter server,
tool calls read with ``--sglang-tool-call-parser``, ``finish_session`` turns the recorded turns into
samples sharing one ``rollout_id``: ``play_episode``); only the tool differs. Each call runs in a worker thread so
the rollout loop keeps serving other episodes while a snippet runs. The reward is the final answer
against the label: ``--custom-rm-path examples.tool_use.reward.reward`` (it reads ``final_answer``
from the metadata written here).
"""

from __future__ import annotations

import asyncio
import json

from examples.python_tool.sandbox import run_python
from examples.python_tool.task import prelude
from examples.tool_use.generate import play_episode
from slime.utils.types import Sample


def run_tool(name: str, arguments: str, x: list[int] | None = None) -> tuple[str, dict | None]:
    """``(answer for the model, parsed arguments or None)``; a bad call is answered with what was wrong.
    With ``x``, the snippet runs after ``x = [...]``."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if name != "python":
        return f"error: unknown tool {name!r}; the only tool is python", parsed
    if not isinstance(parsed, dict) or not isinstance(parsed.get("code"), str):
        return 'error: the arguments of python must be a JSON object with a "code" string, e.g. {"code": "print(1+1)"}', parsed
    if not parsed["code"].strip():
        return run_python(parsed["code"]), parsed  # says the code is empty
    return run_python(parsed["code"] if x is None else prelude(x) + parsed["code"]), parsed


async def generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False):
    x = sample.metadata.get("x")

    async def sandboxed(name: str, arguments: str):
        return await asyncio.to_thread(run_tool, name, arguments, x)  # the loop serves other episodes meanwhile

    return await play_episode(args, sample, sampling_params, sandboxed, evaluation=evaluation, name="python-tool")

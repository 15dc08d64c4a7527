"""The tool-use task: a weather lookup the model must call before it can answer.

Each prompt is one user message ("What is the weather in this city?\\nOslo") and one tool,
``get_weather(city)``. Every problem has its own forecast (a weather per city, drawn at random), kept
in the row's ``metadata`` where only the tool can read it, so the answer cannot be memorised: a
correct episode is a ``get_weather`` call with the asked city, then the tool's answer repeated.
Files (slime's prompt format, INTERFACES §7.1):

* ``train.jsonl`` / ``eval.jsonl``: ``{"messages": [user], "tools": [get_weather], "label": "rainy",
  "metadata": {"city": "Oslo", "forecast": {"Paris": "sunny", ...}}}``;
* ``sft.jsonl``: full transcripts (user, assistant tool call, tool result, assistant answer) with the
  same ``tools`` field, for the SFT warm start that teaches the call format.

    python -m examples.tool_use.task --out /tmp/tool_use_data --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CITIES = ("Paris", "Tokyo", "Berlin", "Lima", "Oslo")
WEATHERS = ("sunny", "rainy", "cloudy", "windy", "snowy")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER_TOOL]


def question(city: str) -> str:
    # The city on a line of its own is the same token as in the tool call's JSON ("Lima", not " Lima"),
    # so looking it up is a copy the tiny model can learn in minutes.
    return f"What is the weather in this city?\n{city}"


def transcript(city: str, weather: str) -> list[dict]:
    """The conversation a perfect agent has (what the SFT warm start imitates)."""
    return [
        {"role": "user", "content": question(city)},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
        {"role": "tool", "content": weather},
        {"role": "assistant", "content": weather},
    ]


def make_row(rng: random.Random, with_transcript: bool) -> dict:
    forecast = {city: rng.choice(WEATHERS) for city in CITIES}
    city = rng.choice(CITIES)
    if with_transcript:
        return {"messages": transcript(city, forecast[city]), "tools": TOOLS}
    return {"messages": [{"role": "user", "content": question(city)}], "tools": TOOLS, "label": forecast[city],
            "metadata": {"city": city, "forecast": forecast}}


def build(out_dir: str | Path, seed: int = 0, num_train: int = 64, num_eval: int = 32, num_sft: int = 256) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for offset, (name, count) in enumerate((("train", num_train), ("eval", num_eval), ("sft", num_sft))):
        rng = random.Random(seed * 1000 + offset)  # each split its own draws
        path = out / f"{name}.jsonl"
        with open(path, "w") as f:
            for _ in range(count):
                f.write(json.dumps(make_row(rng, with_transcript=name == "sft")) + "\n")
        paths[name] = str(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=64)
    parser.add_argument("--num-eval", type=int, default=32)
    parser.add_argument("--num-sft", type=int, default=256)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, args.seed, args.num_train, args.num_eval, args.num_sft)))


if __name__ == "__main__":
    main()

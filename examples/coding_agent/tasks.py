"""Tasks of the coding-agent example: small Python repositories whose tests fail until the agent fixes the code.

    python -m examples.coding_agent.tasks --out DIR [--count 64] [--seed 0]   -> DIR/train.jsonl, DIR/eval.jsonl

Each row: ``prompt`` (the task for the CLI), ``metadata``: ``files`` (the repository: a module with a bug or a
missing body and a ``unittest`` test file) and ``test_command`` (``python3 -B -m unittest -q``, exit code 0 when
solved), ``solution`` (the fixed module, for checking the tests themselves). Load with ``--input-key prompt
--metadata-key metadata``.
"""

from __future__ import annotations

import argparse
import json
import os
import random

TEST_COMMAND = "python3 -B -m unittest -q"  # -B: no bytecode cache a quick edit of the same size could hide behind


def _clamp(rng):
    low, high = sorted(rng.sample(range(-20, 21), 2))
    broken = f"def clamp(x):\n    return max({high}, min({low}, x))\n"
    fixed = f"def clamp(x):\n    return max({low}, min({high}, x))\n"
    tests = (f"import unittest\nfrom mathutil import clamp\n\n\nclass T(unittest.TestCase):\n"
             f"    def test_clamp(self):\n        self.assertEqual(clamp({low - 5}), {low})\n"
             f"        self.assertEqual(clamp({high + 5}), {high})\n        self.assertEqual(clamp({low}), {low})\n")
    prompt = (f"The tests in test_mathutil.py fail. Fix clamp in mathutil.py so that it limits x to "
              f"[{low}, {high}]. Run `{TEST_COMMAND}` to check.")
    return prompt, {"mathutil.py": broken, "test_mathutil.py": tests}, {"mathutil.py": fixed}


def _word_count(rng):
    word = rng.choice(["apple", "river", "stone", "cloud"])
    broken = "def count(text, word):\n    return text.count(word)\n"
    fixed = "def count(text, word):\n    return text.split().count(word)\n"
    tests = (f"import unittest\nfrom words import count\n\n\nclass T(unittest.TestCase):\n"
             f"    def test_whole_words(self):\n        self.assertEqual(count('{word} {word}s {word}', '{word}'), 2)\n")
    prompt = (f"count in words.py should count whole words only, but count('{word} {word}s {word}', '{word}') "
              f"returns 3. Fix it so the tests in test_words.py pass (`{TEST_COMMAND}`).")
    return prompt, {"words.py": broken, "test_words.py": tests}, {"words.py": fixed}


def _implement(rng):
    n = rng.randint(3, 9)
    body = "def triangle(n):\n    raise NotImplementedError\n"
    fixed = "def triangle(n):\n    return n * (n + 1) // 2\n"
    tests = (f"import unittest\nfrom seq import triangle\n\n\nclass T(unittest.TestCase):\n"
             f"    def test_values(self):\n        self.assertEqual(triangle({n}), {n * (n + 1) // 2})\n"
             f"        self.assertEqual(triangle(1), 1)\n")
    prompt = f"Implement triangle(n) in seq.py: the sum 1 + 2 + ... + n. The tests are in test_seq.py (`{TEST_COMMAND}`)."
    return prompt, {"seq.py": body, "test_seq.py": tests}, {"seq.py": fixed}


KINDS = (_clamp, _word_count, _implement)


def make_task(rng: random.Random, index: int) -> dict:
    prompt, files, solution = KINDS[index % len(KINDS)](rng)
    return {"prompt": prompt, "metadata": {"files": files, "test_command": TEST_COMMAND, "solution": solution}}


def write_tasks(out: str, count: int = 64, seed: int = 0, eval_count: int = 8) -> dict[str, str]:
    rng = random.Random(seed)
    os.makedirs(out, exist_ok=True)
    paths = {}
    for split, n in (("train", count), ("eval", eval_count)):
        paths[split] = os.path.join(out, f"{split}.jsonl")
        with open(paths[split], "w") as f:
            for index in range(n):
                row = make_task(rng, index)
                row["metadata"]["split"] = split
                f.write(json.dumps(row) + "\n")
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    print(json.dumps(write_tasks(cli.out, cli.count, cli.seed)))

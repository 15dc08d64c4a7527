"""reasoning-gym (PyPI) in slime: its procedural task generators as prompts, its verifiers as the reward.

Three ways in, all on reasoning-gym's own generators and ``score_answer`` verifiers:

* **data prep** (then the default data source): ``python -m slime.rollout.reasoning_gym --dataset
  chain_sum --config '{"max_terms": 2}' --out DIR`` writes ``train.jsonl`` / ``eval.jsonl`` (and
  ``sft.jsonl`` with ``--num-sft``) in slime's prompt format; every row carries the gym's entry in its
  metadata and ``rm_type: reasoning_gym``, so ``--rm-type reasoning_gym`` (or the row alone) scores it;
* **a data source** that draws fresh problems as training goes (``--data-source-path
  slime.rollout.reasoning_gym.ReasoningGymDataSource``, configured by ``reasoning_gym`` in
  ``--custom-config-path``: ``{"dataset": ..., "config": {...}, "size": ..., "answer_format": ...}``);
* **the reward** ``slime.rollout.reasoning_gym.reward`` (``--custom-rm-path``), the same scorer.

The answer is read from the reply as the row's ``answer_format`` says: ``tag`` (reasoning-gym's
convention, the last ``<answer>...</answer>``; pair with ``--system-prompt default``), ``plain``
(the whole reply, special tokens and any ``<think>`` block removed; for small models that answer
bare) or ``number`` (the last number in the reply, for numeric tasks that a small instruct model
answers in a sentence: "The answer is 42.").
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
import tempfile
from pathlib import Path

from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils.misc import custom_config_value

ANSWER_FORMATS = ("tag", "plain", "number")
_SPECIAL = re.compile(r"<\|[^|>]*\|>")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _jsonable(value):
    """The gym's entry as plain JSON (tuples become lists, anything else its string)."""
    return json.loads(json.dumps(value, default=str))


def make_rows(dataset: str, *, size: int, seed: int, config: dict | None = None, answer_format: str = "tag",
              system_prompt: str | None = None, split: str = "train", exclude: set[str] | None = None) -> list[dict]:
    """``size`` problems of a reasoning-gym dataset as slime prompt rows (questions in ``exclude`` skipped)."""
    import reasoning_gym

    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    system = None
    if system_prompt:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        system = SYSTEM_PROMPTS.get(system_prompt, system_prompt)  # a name of the gym's prompts, or the text
    config = dict(config or {})
    exclude = set(exclude or ())
    rows, draws = [], 0
    while len(rows) < size:
        draws += 1
        if draws > 20:
            raise ValueError(f"reasoning-gym {dataset} {config} gave only {len(rows)} new problems of {size} "
                             f"(its problem space is smaller than asked, or the exclusions cover it)")
        generated = reasoning_gym.create_dataset(dataset, seed=seed + 7919 * (draws - 1), size=size, **config)
        for index in range(len(generated)):
            entry = generated[index]
            if entry["question"] in exclude:
                continue
            exclude.add(entry["question"])
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": entry["question"]}]
            rows.append({"prompt": messages, "label": str(entry["answer"]), "metadata": {
                "rm_type": "reasoning_gym", "split": split, "reasoning_gym": {
                    "dataset": dataset, "config": config, "answer_format": answer_format,
                    "entry": _jsonable(entry)}}})
            if len(rows) == size:
                break
    return rows


@functools.lru_cache(maxsize=64)
def _verifier(dataset: str, config_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(dataset, seed=0, size=1, **json.loads(config_json)).score_answer


def extract_answer(response: str, answer_format: str) -> str | None:
    if answer_format == "tag":
        from reasoning_gym.utils import extract_answer as gym_extract

        return gym_extract(response or "")
    text = _SPECIAL.sub("", response or "")
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if answer_format == "number":
        numbers = _NUMBER.findall(text)
        return numbers[-1].replace(",", "").rstrip(".") if numbers else ""
    return text.strip()


def score(response: str, metadata: dict) -> float:
    """The gym's verdict on a reply, for a row built by :func:`make_rows`."""
    info = metadata.get("reasoning_gym") if isinstance(metadata, dict) else None
    if not isinstance(info, dict) or "entry" not in info or "dataset" not in info:
        raise ValueError("rm_type reasoning_gym needs metadata['reasoning_gym'] = {dataset, config, entry} "
                         "(rows from python -m slime.rollout.reasoning_gym)")
    answer = extract_answer(response, info.get("answer_format", "tag"))
    verify = _verifier(info["dataset"], json.dumps(info.get("config") or {}, sort_keys=True))
    return float(verify(answer, info["entry"]))


async def reward(args, sample, **kwargs):
    """``--custom-rm-path slime.rollout.reasoning_gym.reward``: single sample or a list (batch mode)."""
    if isinstance(sample, list):
        return [score(s.response, s.metadata) for s in sample]
    return score(sample.response, sample.metadata)


class ReasoningGymDataSource(RolloutDataSourceWithBuffer):
    """The default data source over problems a reasoning-gym generator draws at start-up.

    Configured by ``args.reasoning_gym`` (``--custom-config-path`` YAML: ``reasoning_gym: {dataset,
    config, size, seed, answer_format, system_prompt}``). The rows are written to a file and read by
    the default data source (``prompt`` / ``label`` / ``metadata`` keys; ``--apply-chat-template`` as
    usual), so epochs, shuffling, the buffer and the checkpointed position are the default's; a resumed
    run draws the same problems again from the same seed.
    """

    def __init__(self, args):
        spec = custom_config_value(args, "reasoning_gym")
        if not isinstance(spec, dict) or not spec.get("dataset"):
            raise ValueError("ReasoningGymDataSource needs reasoning_gym: {dataset: ..., config: {...}, size: N} "
                             "in --custom-config-path")
        rows = make_rows(spec["dataset"], size=int(spec.get("size", 1000)), seed=int(spec.get("seed", 0)),
                         config=spec.get("config"), answer_format=spec.get("answer_format", "tag"),
                         system_prompt=spec.get("system_prompt"))
        path = Path(tempfile.mkdtemp(prefix="reasoning_gym_")) / f"{spec['dataset']}.jsonl"
        write_jsonl(rows, path)
        patched = copy.copy(args)
        patched.prompt_data, patched.input_key, patched.label_key, patched.metadata_key = \
            str(path), "prompt", "label", "metadata"
        super().__init__(patched)


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build(out_dir, dataset: str, *, config: dict | None = None, num_train: int = 256, num_eval: int = 64,
          num_sft: int = 0, seed: int = 0, answer_format: str = "tag", system_prompt: str | None = None) -> dict:
    """Write train / eval (disjoint questions) and optional SFT rows; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(config=config, answer_format=answer_format, system_prompt=system_prompt)
    train = make_rows(dataset, size=num_train, seed=seed, split="train", **kw)
    sft = make_rows(dataset, size=num_sft, seed=seed + 1, split="sft", **kw) if num_sft else []
    seen = {r["metadata"]["reasoning_gym"]["entry"]["question"] for r in train + sft}
    evals = make_rows(dataset, size=num_eval, seed=seed + 2, split="eval", exclude=seen, **kw)
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    write_jsonl(train, paths["train"])
    write_jsonl(evals, paths["eval"])
    if sft:
        paths["sft"] = out / "sft.jsonl"
        answer = "<answer>{}</answer>" if answer_format == "tag" else "{}"
        write_jsonl([{"messages": r["prompt"] + [{"role": "assistant", "content": answer.format(r["label"])}]}
                     for r in sft], paths["sft"])
    return {k: str(v) for k, v in paths.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write reasoning-gym problems as slime prompt files.")
    parser.add_argument("--dataset", required=True, help="a reasoning-gym dataset name, e.g. chain_sum")
    parser.add_argument("--config", default="{}", help="JSON of the dataset's config, e.g. '{\"max_terms\": 2}'")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--num-sft", type=int, default=0, help="also write an SFT file of gym answers (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answer-format", default="tag", choices=ANSWER_FORMATS)
    parser.add_argument("--system-prompt", default=None, help="a name in reasoning_gym.utils.SYSTEM_PROMPTS, or text")
    a = parser.parse_args(argv)
    print(json.dumps(build(a.out, a.dataset, config=json.loads(a.config), num_train=a.num_train,
                           num_eval=a.num_eval, num_sft=a.num_sft, seed=a.seed, answer_format=a.answer_format,
                           system_prompt=a.system_prompt)))


if __name__ == "__main__":
    main()

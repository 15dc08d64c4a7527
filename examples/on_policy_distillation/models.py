"""The two models of the on-policy distillation example: a weak student and a different, stronger teacher.

Both are tiny Qwen3 models with the same tokenizer (the teacher scores the student's token ids, so
the vocabularies must match): the student is ``slime.utils.tiny_model``'s model (weights seeded
with 0); the teacher is a model of the same shape with its own initial weights (``--teacher-seed``)
and its own training. Each is trained here with a plain PyTorch loop (full batch, Adam) on chat
conversations of the quick start's arithmetic (``a+b=`` → the sum, ``slime.utils.tiny_task``):

* the **teacher** on every problem of the task (``--teacher-steps``, until it answers all of them
  greedily), so it knows the answers;
* the **student** warm-started on fewer problems (``--student-steps`` on the SFT file), so it has
  the reply format and answers depending on the question, but gets many sums wrong (0.57 of all
  problems after the default 120 steps; after 40 it still ignored the question, which OPD did not
  fix: the example's README).

    python -m examples.on_policy_distillation.models --student DIR --teacher DIR --data DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

IM_END = "<|im_end|>"


def conversations(max_operand: int) -> list[list[dict]]:
    """Every ``a+b=`` problem with ``a, b < max_operand`` as a two-message conversation."""
    return [[{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]
            for a in range(max_operand) for b in range(max_operand)]


def _batch(tokenizer, rows: list[list[dict]]):
    """Token ids, labels (the reply and its end token only) and attention mask of ``rows``."""
    pairs = []
    for messages in rows:
        text = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        reply = tokenizer.encode(messages[-1]["content"] + IM_END, add_special_tokens=False)
        pairs.append((list(prompt), reply))
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100)
    attention = torch.zeros(len(pairs), width, dtype=torch.long)
    for i, (prompt, reply) in enumerate(pairs):
        n = len(prompt) + len(reply)
        ids[i, :n] = torch.tensor(prompt + reply)
        labels[i, len(prompt):n] = torch.tensor(reply)
        attention[i, :n] = 1
    return ids, labels, attention, pairs


def greedy_accuracy(model, tokenizer, rows: list[list[dict]]) -> float:
    """Share of ``rows`` whose reply the model produces greedily (exact tokens up to the end token)."""
    _, _, _, pairs = _batch(tokenizer, rows)
    right = 0
    with torch.no_grad():
        for prompt, reply in pairs:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(reply), do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
            right += out[0, len(prompt):].tolist() == reply
    return right / len(pairs)


def train(model, tokenizer, rows: list[list[dict]], steps: int, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """``steps`` full-batch Adam steps of the replies' cross-entropy; returns the losses."""
    ids, labels, attention, _ = _batch(tokenizer, rows)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _read_sft(path: str | Path) -> list[list[dict]]:
    with open(path) as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def build(base: str | Path, student_out: str | Path, teacher_out: str | Path, sft_path: str | Path,
          max_operand: int = 10, teacher_seed: int = 1, teacher_steps: int = 300, student_steps: int = 120) -> dict:
    """Write the student and the teacher (HF directories, the tokenizer of ``base``); return their scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    everything = conversations(max_operand)
    report = {}

    student = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    losses = train(student, tokenizer, _read_sft(sft_path), student_steps)
    report["student"] = {"steps": student_steps, "loss_first": losses[0] if losses else None,
                         "loss_last": losses[-1] if losses else None,
                         "greedy_accuracy_all_problems": greedy_accuracy(student, tokenizer, everything)}

    torch.manual_seed(teacher_seed)  # the same shape, other initial weights
    teacher = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(str(base)).config)
    teacher.generation_config = student.generation_config
    losses = train(teacher, tokenizer, everything, teacher_steps, seed=teacher_seed)
    report["teacher"] = {"steps": teacher_steps, "seed": teacher_seed, "loss_first": losses[0], "loss_last": losses[-1],
                         "greedy_accuracy_all_problems": greedy_accuracy(teacher, tokenizer, everything)}

    for model, out in ((student, student_out), (teacher, teacher_out)):
        out = Path(out)
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a checkpoint of slime.utils.tiny_model (weights and tokenizer)")
    parser.add_argument("--student", required=True, help="where to write the warm-started student")
    parser.add_argument("--teacher", required=True, help="where to write the teacher")
    parser.add_argument("--sft", required=True, help="the student's warm-start conversations (tiny_task's sft.jsonl)")
    parser.add_argument("--max-operand", type=int, default=10)
    parser.add_argument("--teacher-seed", type=int, default=1)
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--student-steps", type=int, default=120)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.base, args.student, args.teacher, args.sft, args.max_operand, args.teacher_seed,
                           args.teacher_steps, args.student_steps)))


if __name__ == "__main__":
    main()

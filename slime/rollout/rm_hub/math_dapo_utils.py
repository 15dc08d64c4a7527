"""DAPO / Minerva-style answer verification (``rm_type == "dapo"``).

The response's last 300 characters are searched for the last ``Answer: <x>`` line (Minerva
format); both prediction and ground truth go through Minerva's ``normalize_final_answer`` (drop
units and filler words, unwrap ``\\text{}``/``\\boxed{}``, strip ``$``, thousands separators, ...)
and are compared as strings. The strict-box mode instead requires the last ``\\boxed{}`` to equal
the ground truth. Score 1.0 if correct, -1.0 otherwise.
"""

from __future__ import annotations

import re

from slime.rollout.rm_hub.math_utils import last_boxed_only_string, remove_boxed

__all__ = [
    "compute_score",
    "verify",
    "is_correct_minerva",
    "is_correct_strict_box",
    "last_boxed_only_string",
    "remove_boxed",
    "normalize_final_answer",
]

SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip

REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]  # fmt: skip


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalisation of a final answer string."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(
    solution_str: str, gt: str, gt_need_extract: bool = False, answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)"
) -> tuple[bool, str]:
    """Minerva check: the last ``Answer:`` match of the solution vs. the ground truth."""
    matches = re.findall(answer_pattern, solution_str)
    extracted = matches[-1] if matches else "[INVALID]"
    pred = normalize_final_answer(extracted)
    if gt_need_extract:
        gt = normalize_final_answer(remove_boxed(last_boxed_only_string(gt)) or "")
    else:
        gt = normalize_final_answer(gt)
    return pred == gt, pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """Strict check: the last ``\\boxed{}`` of the (last 100 chars of the) prediction equals ``gt``."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError("pause_tokens_index must hold 4 indices")
        pred = pred[pause_tokens_index[-1] - 100 :]
    else:
        pred = pred[-100:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(
    solution_str: str, answer: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> tuple[bool, str | None]:
    """Whether ``solution_str`` answers ``answer`` (Minerva, or strict box), and the extracted prediction."""
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    return is_correct_minerva(solution_str, answer)


# End-of-turn tokens a response may still carry (rollouts keep the stop token, no_stop_trim=True).
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>",
              "<|end|>", "<|return|>")


def strip_end_tokens(text: str) -> str:
    """``text`` without the end-of-turn tokens (and whitespace) at its end."""
    text = text.rstrip()
    stripped = True
    while stripped:
        stripped = False
        for token in END_TOKENS:
            if text.endswith(token):
                text, stripped = text[: -len(token)].rstrip(), True
    return text


def _coerce_ground_truth(ground_truth) -> str:
    gt = str(ground_truth)
    if "\\boxed" in gt:
        gt = remove_boxed(last_boxed_only_string(gt)) or gt
    normalized = normalize_final_answer(gt)
    try:
        value = float(normalized)
    except ValueError:
        return gt
    return str(int(value)) if value.is_integer() else gt


def compute_score(
    solution_str: str, ground_truth, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> dict:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}`` for a DAPO math answer."""
    solution_str = strip_end_tokens(solution_str or "")[-300:]
    correct, pred = verify(solution_str, _coerce_ground_truth(ground_truth), strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred if pred is not None else ""}

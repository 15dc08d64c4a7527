"""DeepScaleR rule reward: the boxed answer after the reasoning block, graded by mathd or sympy."""

from __future__ import annotations

from slime.rollout.rm_hub.math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy


def get_deepscaler_rule_based_reward(response: str, label) -> int:
    """1 if the boxed answer after the last ``</think>`` (or ``###Response``) matches ``label``, else 0."""
    response = response or ""  # a missing response scores 0, as a malformed one does
    if "</think>" in response:
        model_solution = response.split("</think>")[-1]
    elif "###Response" in response:
        model_solution = response.split("###Response")[-1]
    else:
        return 0
    model_answer = extract_answer(model_solution)
    if model_answer is None or label is None or str(label) == "":
        return 0
    label = str(label)
    if "\\boxed" in label:
        label = extract_answer(label)
        if label is None:
            return 0
    return int(grade_answer_mathd(model_answer, label) or grade_answer_sympy(model_answer, label))

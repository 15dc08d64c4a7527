"""SQuAD-style token F1 between a response and the label (``rm_type == "f1"``)."""

from __future__ import annotations

import re
import string
from collections import Counter


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """``(f1, precision, recall)`` over normalised tokens; yes/no/noanswer must match exactly."""
    if prediction is None:
        return 0.0, 0.0, 0.0
    pred_norm, gt_norm = normalize_answer(prediction), normalize_answer(str(ground_truth))
    special = {"yes", "no", "noanswer"}
    if (pred_norm in special or gt_norm in special) and pred_norm != gt_norm:
        return 0.0, 0.0, 0.0
    pred_tokens, gt_tokens = pred_norm.split(), gt_norm.split()
    common = Counter(pred_tokens) & Counter(gt_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0, 0.0, 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gt_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall

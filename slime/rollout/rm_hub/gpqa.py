"""Multiple-choice reward for GPQA-style questions (``rm_type == "gpqa"``).

Valid letters come from ``metadata["valid_letters"]``, else ``A..`` for ``len(metadata["choices"])``,
else A–J. The correct letter is ``metadata["correct_letter"]``, a one-letter label, an integer label
(choice index), or the choice whose text matches the label. The predicted letter is read from the
text after the last ``</think>``: "answer/option/choice is X", "X is correct", "final answer X",
else the last standalone valid capital letter. Without a letter, a normalised substring match of
the correct answer text counts.
"""

from __future__ import annotations

import re
import string

DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])


def _normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in text)
    return " ".join(text.split())


def _valid_letters(metadata: dict) -> list[str]:
    letters = metadata.get("valid_letters")
    if letters:
        return [str(x).strip().upper() for x in letters]
    choices = metadata.get("choices")
    if isinstance(choices, dict) and choices:
        return [str(k).strip().upper() for k in choices]
    if isinstance(choices, (list, tuple)) and choices:
        return list(string.ascii_uppercase[: len(choices)])
    return DEFAULT_VALID_LETTERS


def _choice_texts(metadata: dict, letters: list[str]) -> dict[str, str]:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return {str(k).strip().upper(): str(v) for k, v in choices.items()}
    if isinstance(choices, (list, tuple)):
        return {letter: str(text) for letter, text in zip(letters, choices)}
    return {}


def _correct_letter(label, metadata: dict, letters: list[str], texts: dict[str, str]) -> str | None:
    explicit = metadata.get("correct_letter")
    if isinstance(explicit, str) and explicit.strip().upper() in letters:
        return explicit.strip().upper()
    if isinstance(label, bool):
        return None
    if isinstance(label, int) and 0 <= label < len(letters):
        return letters[label]
    if isinstance(label, str):
        stripped = label.strip().strip("().").upper()
        if len(stripped) == 1 and stripped in letters:
            return stripped
        if label.strip().isdigit() and 0 <= int(label.strip()) < len(letters) and not texts:
            return letters[int(label.strip())]
        normalized = _normalize(label)
        for letter, text in texts.items():
            if _normalize(text) == normalized:
                return letter
    return None


def _extract_letter(response: str, letters: list[str]) -> str | None:
    text = response.split("</think>")[-1]
    alternatives = "|".join(re.escape(x) for x in letters)
    patterns = [
        rf"(?i)(?:answer|option|choice)\s*(?:is|:)?\s*[:\-]?\s*\(?\**\s*({alternatives})\b",
        rf"\(?\b({alternatives})\)?\s+is\s+(?:the\s+)?correct",
        rf"(?i)final\s+answer\s*[:\-]?\s*(?:is\s*)?\(?\**\s*({alternatives})\b",
    ]
    for pattern in patterns:
        matches = re.findall(pattern, text)
        matches = [m.upper() for m in matches if m.upper() in letters]
        if matches:
            return matches[-1]
    standalone = re.findall(rf"(?<![A-Za-z])({alternatives})(?![A-Za-z])", text)
    return standalone[-1] if standalone else None


def compute_gpqa_reward(response: str, label, metadata: dict | None = None) -> float:
    """1.0 if the chosen option is the correct one, else 0.0."""
    if response is None:
        return 0.0
    metadata = metadata or {}
    letters = _valid_letters(metadata)
    texts = _choice_texts(metadata, letters)
    correct = _correct_letter(label, metadata, letters, texts)
    predicted = _extract_letter(response, letters)
    if predicted is not None and correct is not None:
        return 1.0 if predicted == correct else 0.0
    answer_text = metadata.get("correct_answer") or metadata.get("answer_text")
    if answer_text is None and correct is not None:
        answer_text = texts.get(correct)
    if answer_text is None and isinstance(label, str) and correct is None:
        answer_text = label
    if answer_text:
        target = _normalize(str(answer_text))
        return 1.0 if target and target in _normalize(response.split("</think>")[-1]) else 0.0
    return 0.0

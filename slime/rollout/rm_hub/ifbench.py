"""Instruction-following reward (``rm_type == "ifbench"``): strict evaluation of verifiable instructions.

``metadata`` carries ``instruction_id_list`` and a parallel ``kwargs`` list (plus ``prompt_text``,
``record_id``). The reward is 1.0 when every instruction is followed, else 0.0; missing metadata
gives 0.0. The checks are written from the public IFEval definitions (Zhou et al. 2023,
"Instruction-Following Evaluation for Large Language Models"), which IFBench's evaluation builds on.

Covered ids: see :data:`INSTRUCTION_CHECKS` (the IFEval set except ``language:response_language``,
which needs a language detector). Any other id — including IFBench's out-of-distribution
instructions — cannot be verified here: it scores 0 for the record and a warning names it once.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Callable

logger = logging.getLogger(__name__)
_warned_ids: set[str] = set()


def _compare(value: int, relation: str | None, target: int) -> bool:
    relation = (relation or "at least").strip().lower()
    if relation == "less than":
        return value < target
    if relation == "at least":
        return value >= target
    raise ValueError(f"unknown relation {relation!r}; expected 'less than' or 'at least'")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]


def _no_comma(response, **_):
    return "," not in response


def _lowercase(response, **_):
    return response == response.lower()


def _capital(response, **_):
    return response == response.upper()


def _capital_word_frequency(response, capital_frequency, capital_relation=None, **_):
    count = sum(1 for w in _words(response) if w.isupper())
    return _compare(count, capital_relation, int(capital_frequency))


def _number_words(response, num_words, relation=None, **_):
    return _compare(len(_words(response)), relation, int(num_words))


def _number_sentences(response, num_sentences, relation=None, **_):
    return _compare(len(_sentences(response)), relation, int(num_sentences))


def _number_paragraphs(response, num_paragraphs, **_):
    paragraphs = re.split(r"\s?\*\*\*\s?", response)
    if any(not p.strip() for p in paragraphs[1:-1]):
        return False
    count = len([p for p in paragraphs if p.strip()])
    return count == int(num_paragraphs)


def _nth_paragraph_first_word(response, num_paragraphs, nth_paragraph, first_word, **_):
    paragraphs = [p for p in re.split(r"\n\n", response) if p.strip()]
    if len(paragraphs) != int(num_paragraphs) or int(nth_paragraph) > len(paragraphs):
        return False
    words = _words(paragraphs[int(nth_paragraph) - 1].strip().lstrip("\"'"))
    return bool(words) and words[0].lower() == str(first_word).lower()


def _number_bullet_lists(response, num_bullets, **_):
    stars = re.findall(r"^\s*\*[^\*].*$", response, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", response, flags=re.MULTILINE)
    return len(stars) + len(dashes) == int(num_bullets)


def _title(response, **_):
    return any(t.strip() for t in re.findall(r"<<[^\n]+>>", response))


def _json_format(response, **_):
    text = response.strip()
    text = re.sub(r"^```(?:json|Json|JSON)?\s*", "", text)
    text = re.sub(r"\s*```$", "", text)
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _multiple_sections(response, section_spliter, num_sections, **_):
    sections = re.split(r"\s?" + re.escape(section_spliter) + r"\s?\d+\s?", response)
    return len(sections) - 1 >= int(num_sections)


def _highlighted_sections(response, num_highlights, **_):
    count = sum(1 for h in re.findall(r"\*[^\n\*]*\*", response) if h.strip("*").strip())
    count += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", response) if h.removeprefix("**").removesuffix("**").strip())
    return count >= int(num_highlights)


def _constrained_response(response, **_):
    return any(option in response.strip() for option in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


def _end_checker(response, end_phrase, **_):
    return response.strip().strip('"').lower().endswith(str(end_phrase).strip().lower())


def _quotation(response, **_):
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def _keywords_existence(response, keywords, **_):
    return all(re.search(re.escape(k), response, flags=re.IGNORECASE) for k in keywords)


def _forbidden_words(response, forbidden_words, **_):
    return not any(re.search(r"\b" + re.escape(w) + r"\b", response, flags=re.IGNORECASE) for w in forbidden_words)


def _keyword_frequency(response, keyword, frequency, relation=None, **_):
    return _compare(len(re.findall(re.escape(keyword), response, flags=re.IGNORECASE)), relation, int(frequency))


def _letter_frequency(response, letter, let_frequency, let_relation=None, **_):
    return _compare(response.lower().count(str(letter).lower()), let_relation, int(let_frequency))


def _postscript(response, postscript_marker, **_):
    marker = str(postscript_marker).strip()
    if marker.upper() == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker.upper() == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker.lower()) + r".*$"
    return bool(re.findall(pattern, response.lower(), flags=re.MULTILINE))


def _placeholders(response, num_placeholders, **_):
    return len(re.findall(r"\[.*?\]", response)) >= int(num_placeholders)


def _repeat_prompt(response, prompt_to_repeat, **_):
    return response.strip().lower().startswith(str(prompt_to_repeat).strip().lower())


def _two_responses(response, **_):
    parts = response.split("******")
    valid = []
    for i, part in enumerate(parts):
        if not part.strip():
            if 0 < i < len(parts) - 1:
                return False
        else:
            valid.append(part.strip())
    return len(valid) == 2 and valid[0] != valid[1]


INSTRUCTION_CHECKS: dict[str, Callable[..., bool]] = {
    "punctuation:no_comma": _no_comma,
    "change_case:english_lowercase": _lowercase,
    "change_case:english_capital": _capital,
    "change_case:capital_word_frequency": _capital_word_frequency,
    "length_constraints:number_words": _number_words,
    "length_constraints:number_sentences": _number_sentences,
    "length_constraints:number_paragraphs": _number_paragraphs,
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    "detectable_format:number_bullet_lists": _number_bullet_lists,
    "detectable_format:title": _title,
    "detectable_format:json_format": _json_format,
    "detectable_format:multiple_sections": _multiple_sections,
    "detectable_format:number_highlighted_sections": _highlighted_sections,
    "detectable_format:constrained_response": _constrained_response,
    "startend:end_checker": _end_checker,
    "startend:quotation": _quotation,
    "keywords:existence": _keywords_existence,
    "keywords:forbidden_words": _forbidden_words,
    "keywords:frequency": _keyword_frequency,
    "keywords:letter_frequency": _letter_frequency,
    "detectable_content:postscript": _postscript,
    "detectable_content:number_placeholders": _placeholders,
    "combination:repeat_prompt": _repeat_prompt,
    "combination:two_responses": _two_responses,
}


def compute_ifbench_reward(response: str, label=None, metadata: dict | None = None) -> float:
    """1.0 iff every instruction in ``metadata["instruction_id_list"]`` is followed (strict)."""
    metadata = metadata or {}
    instruction_ids = metadata.get("instruction_id_list")
    if not instruction_ids or response is None:
        return 0.0
    kwargs_list = metadata.get("kwargs") or [{}] * len(instruction_ids)
    if len(kwargs_list) != len(instruction_ids):
        raise ValueError(
            f"ifbench metadata: {len(instruction_ids)} instruction ids but {len(kwargs_list)} kwargs entries"
        )
    for instruction_id, kwargs in zip(instruction_ids, kwargs_list):
        check = INSTRUCTION_CHECKS.get(instruction_id)
        if check is None:
            if instruction_id not in _warned_ids:
                _warned_ids.add(instruction_id)
                logger.warning("ifbench: instruction %r has no checker here; records with it score 0", instruction_id)
            return 0.0
        kwargs = {k: v for k, v in (kwargs or {}).items() if v is not None}
        if not response.strip() or not check(response, **kwargs):
            return 0.0
    return 1.0

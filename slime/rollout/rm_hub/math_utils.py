"""Math answer extraction and equivalence (MATH-style normalisation, sympy and math-verify checks).

* ``last_boxed_only_string`` / ``remove_boxed`` / ``extract_boxed_answer``: find the last
  ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``) with brace matching, so nested braces such as
  ``\\boxed{\\frac{1}{2}}`` survive.
* ``mathd_normalize_answer`` + ``grade_answer_mathd``: the Hendrycks MATH string normalisation
  (units, ``\\left``/``\\right``, ``dfrac``→``frac``, ``0.5`` prefixes, ...).
* ``grade_answer_sympy``: PRM800K-style normalisation followed by a sympy ``simplify(a - b) == 0``
  check, so ``\\frac{1}{2}`` equals ``0.5``.
* ``grade_answer_math_verify``: the ``math-verify`` package (parsing timeouts off, because rewards
  run on slime's background loop thread where signal-based timeouts are unavailable).
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- boxed extraction


def last_boxed_only_string(string: str | None) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` expression of ``string`` (with the command), or None."""
    if not string:
        return None
    idx = max(string.rfind("\\boxed"), string.rfind("\\fbox"))
    if idx < 0:
        return None
    if string.startswith("\\boxed ", idx):  # "\boxed 5" form: up to the next "$" or end
        rest = string[idx + len("\\boxed ") :]
        return "\\boxed " + rest.split("$")[0].strip()
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[idx : i + 1]
    return None


def remove_boxed(s: str | None) -> str | None:
    """Strip the ``\\boxed{`` ... ``}`` wrapper (or ``\\boxed `` / ``\\fbox{``) from a boxed string."""
    if s is None:
        return None
    for prefix in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if s.startswith(prefix):
            inner = s[len(prefix) :]
            return inner if prefix == "\\boxed " else inner[:-1] if inner.endswith("}") else inner
    return s


def extract_boxed_answer(solution: str | None) -> str | None:
    """Content of the last boxed expression of ``solution``, or None if there is none."""
    return remove_boxed(last_boxed_only_string(solution))


def extract_answer(passage: str | None) -> str | None:
    """Answer of a solution: its last boxed content if any, else None."""
    if passage is None or "\\boxed" not in passage and "\\fbox" not in passage:
        return None
    return extract_boxed_answer(passage)


# ----------------------------------------------------------------------------- MATH normalisation


def _fix_fracs(string: str) -> str:
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr and substr[0] == "{":
            new_str += substr
            continue
        if len(substr) < 2:
            return string
        a, b = substr[0], substr[1]
        if b != "{":
            new_str += "{" + a + "}{" + b + "}" + substr[2:]
        else:
            new_str += "{" + a + "}" + b + substr[2:]
    return new_str


def _fix_a_slash_b(string: str) -> str:
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if string == f"{a}/{b}" else string


def _remove_right_units(string: str) -> str:
    if "\\text{ " in string:
        return string.split("\\text{ ")[0]
    return string


def _fix_sqrt(string: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", string)


def mathd_normalize_answer(answer: str | None) -> str | None:
    """Hendrycks-MATH normalisation of an answer string (None stays None)."""
    if answer is None:
        return None
    string = str(answer).strip()
    string = string.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "").replace("$", "")
    string = _remove_right_units(string)
    string = string.replace("\\%", "").replace("\%", "").replace("%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    string = _fix_a_slash_b(string)
    return string


def grade_answer_mathd(given_answer: str | None, ground_truth: str | None) -> bool:
    """Exact match after MATH normalisation."""
    if given_answer is None or ground_truth is None:
        return False
    return mathd_normalize_answer(given_answer) == mathd_normalize_answer(ground_truth)


# ----------------------------------------------------------------------------- sympy grading

_UNIT_WORDS = [
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
    "foot", "feet", "inch", "yard", "liter", "dollar", "cent", "unit", "square", "kg", "gram", "mph",
]  # fmt: skip


def _strip_units_and_text(expr: str) -> str:
    expr = re.sub(r"\\text\{(.*?)\}", r"\1", expr)
    expr = re.sub(r"\\mbox\{(.*?)\}", r"\1", expr)
    for word in _UNIT_WORDS:
        expr = re.sub(rf"(\d)\s*{word}(e?s)?(\^?[23])?\b", r"\1", expr)
    return expr


def _normalize_for_sympy(expr: str | None) -> str | None:
    if expr is None:
        return None
    expr = str(expr).strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m:
        expr = m.group("text")
    expr = _strip_units_and_text(expr)
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    expr = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", expr)  # thousands separators
    expr = expr.replace("{", "").replace("}", "") if "\\" not in expr else expr
    expr = expr.replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    expr = expr.replace(" ", "")
    expr = expr.replace("\\left", "").replace("\\right", "").replace("dfrac", "frac").replace("tfrac", "frac")
    expr = expr.replace("^{\\circ}", "").replace("^\\circ", "")
    if expr.endswith("."):
        expr = expr[:-1]
    return expr.lower() if re.fullmatch(r"[A-Za-z]+", expr or "") else expr


def _latex_to_sympy(expr: str):
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    text = expr
    text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
    text = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", text)
    text = text.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    text = text.replace("{", "(").replace("}", ")")
    if "\\" in text:
        raise ValueError(f"unsupported LaTeX in {expr!r}")
    return parse_expr(text, transformations=standard_transformations + (implicit_multiplication_application,),
                      local_dict={"pi": sympy.pi, "e": sympy.E})  # fmt: skip


def _split_tuple(expr: str) -> list[str]:
    if len(expr) > 2 and expr[0] in "([" and expr[-1] in ")]" and "," in expr:
        return [part.strip() for part in expr[1:-1].split(",")]
    if "," in expr and not re.search(r"\d,\d{3}", expr):
        return [part.strip() for part in expr.split(",")]
    return [expr]


def _sympy_equal(a: str, b: str) -> bool:
    import sympy

    try:
        diff = sympy.simplify(_latex_to_sympy(a) - _latex_to_sympy(b))
        return diff == 0
    except Exception:  # any parse/simplify failure means "cannot show equal"
        return False


def grade_answer_sympy(given_answer: str | None, ground_truth: str | None) -> bool:
    """Equivalence via normalisation then sympy simplification (element-wise for tuples/lists)."""
    gt = _normalize_for_sympy(ground_truth)
    given = _normalize_for_sympy(given_answer)
    if gt is None or given is None or not gt or not given:
        return False
    if gt == given:
        return True
    gt_elems, given_elems = _split_tuple(gt), _split_tuple(given)
    if len(gt_elems) != len(given_elems):
        return False
    if len(gt_elems) > 1 and (gt[0] != given[0] or gt[-1] != given[-1]):
        return False  # interval/tuple brackets must agree
    for g, p in zip(gt_elems, given_elems):
        if g == p:
            continue
        if re.fullmatch(r"-?\d+", g) and re.fullmatch(r"-?\d+(\.\d+)?", p) and float(p) != int(g):
            return False
        if not _sympy_equal(g, p):
            return False
    return True


def grade_answer_math_verify(given_answer: str | None, ground_truth: str | None) -> bool:
    """Equivalence according to the ``math-verify`` package (False when it cannot parse either side)."""
    if not given_answer or ground_truth is None or str(ground_truth) == "":
        return False
    from math_verify import parse, verify

    gold = parse(f"${ground_truth}$", parsing_timeout=None)
    pred = parse(f"${given_answer}$", parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def grade_answer_verl(solution_str: str, ground_truth: str) -> bool:
    """Boxed answer of ``solution_str`` vs. ground truth (itself possibly boxed), by mathd or sympy."""
    if not ground_truth:
        return False
    ground_truth = str(ground_truth)
    if "\\boxed" in ground_truth:
        ground_truth = extract_answer(ground_truth)
    given = extract_answer(solution_str)
    if given is None:
        return False
    return grade_answer_mathd(given, ground_truth) or grade_answer_sympy(given, ground_truth)


def compute_math_reward(response: str, label) -> int:
    """``rm_type == "math"``: 1 if the last boxed answer equals the label, else 0."""
    if label is None or str(label).strip() == "":
        return 0
    label = str(label)
    if "\\boxed" in label:
        label = extract_boxed_answer(label) or ""
    given = extract_boxed_answer(response)
    if given is None:
        return 0
    if grade_answer_mathd(given, label) or grade_answer_sympy(given, label):
        return 1
    try:
        return int(grade_answer_math_verify(given, label))
    except Exception as e:  # math-verify is a best-effort third opinion
        logger.debug("math-verify failed on %r vs %r: %s", given, label, e)
        return 0

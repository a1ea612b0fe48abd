"""Answer normalisation and matching, shared by the answer-scored suites.

- `extract_answer`: the answer inside a model's text: the last ``\\boxed{...}``
  (braces balanced), else what follows the last "answer is"/"Answer:", else the
  whole text.
- `parse_number`: an exact `Fraction` from the ways numbers get written: ``1,234``,
  ``-3.5``, ``−2`` (Unicode minus), ``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``-style
  braces, ``1.2e3``, ``1.2 \\times 10^{3}``, ``x = 5``, ``$5``, ``25\\%``, mixed
  numbers ``2 1/2``. Returns None for anything else (expressions, words).
- `numbers_match`: exact for exact golds, relative/absolute tolerance for floats.
- `answers_match`: number comparison when both sides parse, else normalised text.
- `normalize_text`, `exact_match`, `token_f1`: SQuAD-style (lower case, no
  punctuation or articles, collapsed spaces); EM and F1 take the best over golds.

Limits: no symbolic algebra (``2\\sqrt{2}`` vs ``\\sqrt{8}`` compare as text), no
intervals, sets or matrices; a percentage keeps its number (``25%`` reads as 25).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*", re.IGNORECASE)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_TIMES_TEN = re.compile(r"^(.+?)\s*(?:\\times|\\cdot|×|\*|x)\s*10\s*\^\s*\{?\s*([-+−]?\d+)\s*\}?$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")
_PLAIN = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")
_MIXED = re.compile(r"^([-+]?\d+)\s+(\d+)/(\d+)$")
_LHS = re.compile(r"^[A-Za-z]\w*\s*=\s*")
# Order matters: the escaped forms go before their bare characters.
_DECORATIONS = (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                ("\\ ", " "), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""))


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}``, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i].strip()
    return None


def extract_answer(text: str) -> str:
    """The answer part of a model's text (see the module docstring)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        tail = text[matches[-1].end():].strip()
        line = tail.splitlines()[0] if tail else ""
        # Up to the end of the sentence: "is 3.5 m/s. Then..." -> "3.5 m/s".
        return re.split(r"\.(?:\s|$)", line)[0].strip()
    return text.strip()


def _strip_decoration(text: str) -> str:
    s = text.strip().replace("−", "-").replace("–", "-")
    for token, replacement in _DECORATIONS:
        s = s.replace(token, replacement)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mathrm\{([^{}]*)\}", r"\1", s)
    s = s.strip().rstrip(".").strip()
    s = _LHS.sub("", s)
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1].strip()
    return s


def parse_number(text: str) -> Fraction | None:
    """An exact value of a written number, or None (see the module docstring)."""
    s = _strip_decoration(text)
    if not s or len(s) > 100:
        return None
    s = _LATEX_FRAC.sub(r"(\1)/(\2)", s)
    s = _LATEX_FRAC_SHORT.sub(r"\1/\2", s)
    sci = _TIMES_TEN.match(s)
    if sci:
        mantissa = parse_number(sci.group(1))
        if mantissa is None:
            return None
        return mantissa * Fraction(10) ** int(sci.group(2).replace("−", "-"))
    s = s.replace(" ", "") if not _MIXED.match(s) else s
    mixed = _MIXED.match(s)
    if mixed:
        whole, top, bottom = int(mixed.group(1)), int(mixed.group(2)), int(mixed.group(3))
        if bottom == 0:
            return None
        frac = Fraction(top, bottom)
        return whole - frac if mixed.group(1).startswith("-") else whole + frac
    if "/" in s:
        num_text, _, den_text = s.partition("/")
        num, den = _simple(num_text.strip("()")), _simple(den_text.strip("()"))
        if num is None or den is None or den == 0:
            return None
        return num / den
    return _simple(s)


def _simple(s: str) -> Fraction | None:
    s = s.strip()
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1].strip()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if not _PLAIN.match(s):
        return None
    return Fraction(s)


def numbers_match(value: Fraction | float, gold: Fraction | float, *,
                  rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Exact equality, or within max(rel_tol × |gold|, abs_tol) (for rounded decimals)."""
    if value == gold:
        return True
    return abs(float(value) - float(gold)) <= max(rel_tol * abs(float(gold)), abs_tol)


def normalize_math_text(text: str) -> str:
    """Text form for non-numeric math answers: no spaces, braces, decorations, case."""
    s = _strip_decoration(text).lower()
    return re.sub(r"[\s{}]", "", s)


def answers_match(predicted: str, gold: str, *, rel_tol: float = 1e-6) -> bool:
    """Numbers when both parse, else normalised text."""
    p, g = parse_number(predicted), parse_number(gold)
    if p is not None and g is not None:
        return numbers_match(p, g, rel_tol=rel_tol)
    return bool(normalize_math_text(predicted)) and \
        normalize_math_text(predicted) == normalize_math_text(gold)


def normalize_text(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = text.lower()
    s = "".join(" " if ch in string.punctuation else ch for ch in s)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(predicted: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold, else 0.0."""
    p = normalize_text(predicted)
    return 1.0 if any(p == normalize_text(g) for g in golds) else 0.0


def token_f1(predicted: str, golds: Sequence[str]) -> float:
    """Best token-overlap F1 between the prediction and any gold (normalised tokens)."""
    p_tokens = normalize_text(predicted).split()
    best = 0.0
    for gold in golds:
        g_tokens = normalize_text(gold).split()
        if not p_tokens or not g_tokens:
            best = max(best, float(p_tokens == g_tokens))
            continue
        common = sum((Counter(p_tokens) & Counter(g_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(p_tokens), common / len(g_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best

"""`math`: problems with exact answers, generated from a seed, plus user JSONL.

Generated kinds (each a small template with random parameters; the answer is
computed exactly with `Fraction`, never by floating point):

- arithmetic: ``arith`` (integer expressions), ``fraction`` (fraction arithmetic),
  ``modpow`` (remainders of powers), ``lcm``, ``divisible`` (inclusion-exclusion);
- algebra: ``linear`` (one unknown), ``system`` (two unknowns), ``roots`` (Vieta),
  ``series`` (arithmetic series);
- combinatorics: ``committee``, ``podium``, ``arrange`` (letters with repeats),
  ``grid``, ``handshake``, ``marbles`` (probability);
- word problems: ``discount``, ``pipes``, ``ages``.

Task format (one JSON object per line)::

    {"id": "my-1", "question": "What is 2 + 2?", "answer": "4",
     "tolerance": 1e-6, "kind": "arith"}

``question`` (string, required) is shown to the model; ``answer`` (string or
number, required) is the gold: an integer, a decimal, a fraction ("19/12",
"\\frac{19}{12}") or, for non-numeric answers, text compared after normalisation;
``tolerance`` (optional, default 1e-6) is the relative tolerance for a numeric
answer; ``kind`` (optional) is a label for metrics.

Reward: 1.0 if the answer (submitted, or the last ``\\boxed{}``/"answer is" of the
final message) equals the gold (numbers: exactly, or within the tolerance; commas,
``$``, ``x =``, LaTeX fractions are normalised away), else 0.0.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from treadle.envs.base import RewardResult
from treadle.envs.errors import TaskFormatError
from treadle.envs.records import check_keys, opt_float, opt_str, req_str, rng_for
from treadle.envs.scoring import answers_match, extract_answer, parse_number
from treadle.envs.suites._answer import AnswerSuite, count
from treadle.types import Task

Problem = tuple[str, Fraction]  # (question, exact answer)
_FIELDS = {"question", "answer", "tolerance", "kind"}
PROMPT = (
    "Solve the following problem. You can run Python code with the `python` tool. "
    "When you are done, call `submit_answer` with only the final answer (an integer, or a "
    "fraction in lowest terms such as 7/3), or end your reply with \\boxed{{answer}}.\n\n"
    "Problem: {question}")


def _nz(rng: random.Random, lo: int, hi: int) -> int:
    """A random non-zero integer in [lo, hi]."""
    while True:
        value = rng.randint(lo, hi)
        if value:
            return value


def _signed(value: int, first: bool = False) -> str:
    if first:
        return str(value)
    return f"+ {value}" if value >= 0 else f"- {-value}"


def _term(coef: int, var: str, first: bool = False) -> str:
    """`coef`·`var` as people write it: "x", "-x", "3y", "+ 2y", "- y"."""
    body = var if abs(coef) == 1 else f"{abs(coef)}{var}"
    if first:
        return body if coef > 0 else f"-{body}"
    return f"+ {body}" if coef > 0 else f"- {body}"


def _arith(rng: random.Random) -> Problem:
    a, b, c, d = (rng.randint(2, 60) for _ in range(4))
    form = rng.randrange(3)
    if form == 0:
        return f"Compute ({a} + {b}) * {c} - {d}.", Fraction((a + b) * c - d)
    if form == 1:
        return f"Compute {a} * {b} - {c} * {d}.", Fraction(a * b - c * d)
    return f"Compute {a}^2 + {b}^2 - {c} * {d}.", Fraction(a * a + b * b - c * d)


def _fraction(rng: random.Random) -> Problem:
    x = Fraction(rng.randint(1, 12), rng.randint(2, 12))
    y = Fraction(rng.randint(1, 12), rng.randint(2, 12))
    op = rng.choice("+-*/")
    value = {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op]
    word = {"+": "+", "-": "-", "*": "times", "/": "divided by"}[op]
    return (f"Compute {x.numerator}/{x.denominator} {word} {y.numerator}/{y.denominator}. "
            "Give the result as a fraction in lowest terms."), value


def _modpow(rng: random.Random) -> Problem:
    a, b, m = rng.randint(2, 19), rng.randint(20, 200), rng.randint(5, 23)
    return f"What is the remainder when {a}^{b} is divided by {m}?", Fraction(pow(a, b, m))


def _lcm(rng: random.Random) -> Problem:
    a, b = rng.randint(6, 90), rng.randint(6, 90)
    return (f"What is the least common multiple of {a} and {b}?",
            Fraction(a * b // math.gcd(a, b)))


def _divisible(rng: random.Random) -> Problem:
    n, a, b = rng.randint(100, 1000), rng.randint(2, 9), rng.randint(2, 13)
    while b == a:
        b = rng.randint(2, 13)
    lcm = a * b // math.gcd(a, b)
    value = (n - 1) // a + (n - 1) // b - (n - 1) // lcm
    return (f"How many positive integers less than {n} are divisible by {a} or by {b}?",
            Fraction(value))


def _linear(rng: random.Random) -> Problem:
    a, c = _nz(rng, -9, 9), _nz(rng, -9, 9)
    while c == a:
        c = _nz(rng, -9, 9)
    b, d = rng.randint(-30, 30), rng.randint(-30, 30)
    left, right = f"{_term(a, 'x', True)} {_signed(b)}", f"{_term(c, 'x', True)} {_signed(d)}"
    return f"Solve for x: {left} = {right}.", Fraction(d - b, a - c)


def _system(rng: random.Random) -> Problem:
    x, y = rng.randint(-9, 9), rng.randint(-9, 9)
    while True:
        a1, b1, a2, b2 = (_nz(rng, -6, 6) for _ in range(4))
        if a1 * b2 - a2 * b1:
            break
    ask = rng.choice(("x + y", "x * y", "x - y"))
    value = {"x + y": x + y, "x * y": x * y, "x - y": x - y}[ask]
    return (f"If {_term(a1, 'x', True)} {_term(b1, 'y')} = {a1 * x + b1 * y} and "
            f"{_term(a2, 'x', True)} {_term(b2, 'y')} = "
            f"{a2 * x + b2 * y}, what is {ask}?", Fraction(value))


def _roots(rng: random.Random) -> Problem:
    r, s = rng.randint(-9, 9), rng.randint(-9, 9)
    total, product = r + s, r * s
    middle = f" {_term(-total, 'x')}" if total else ""
    return (f"The equation x^2{middle} {_signed(product)} = 0 has roots p and q (possibly "
            "equal). "
            "What is p^2 + q^2?", Fraction(total * total - 2 * product))


def _series(rng: random.Random) -> Problem:
    a, d, n = rng.randint(-20, 40), _nz(rng, -7, 9), rng.randint(8, 40)
    terms = ", ".join(str(a + k * d) for k in range(3))
    return (f"What is the sum of the first {n} terms of the arithmetic sequence {terms}, ...?",
            Fraction(n * (2 * a + (n - 1) * d), 2))


def _committee(rng: random.Random) -> Problem:
    n, k = rng.randint(6, 25), rng.randint(2, 5)
    return (f"A club with {n} members chooses a committee of {k}. How many different "
            "committees are possible?", Fraction(math.comb(n, k)))


def _podium(rng: random.Random) -> Problem:
    n = rng.randint(5, 30)
    return (f"{n} runners finish a race with no ties. In how many ways can the gold, silver "
            "and bronze medals be awarded?", Fraction(math.perm(n, 3)))


def _arrange(rng: random.Random) -> Problem:
    letters = rng.sample("BCDFGKLMNPRSTV", 2) + rng.sample("AEIOU", 2)
    counts = [rng.randint(1, 3) for _ in letters]
    chars = [ch for ch, k in zip(letters, counts, strict=True) for _ in range(k)]
    rng.shuffle(chars)
    word = "".join(chars)
    value = math.factorial(len(word))
    for k in counts:
        value //= math.factorial(k)
    return (f"How many distinct arrangements of the letters of the made-up word {word} "
            "are there?", Fraction(value))


def _grid(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"A robot walks on a grid from (0, 0) to ({a}, {b}), each step moving one unit "
            "right or one unit up. How many different paths can it take?",
            Fraction(math.comb(a + b, a)))


def _handshake(rng: random.Random) -> Problem:
    n = rng.randint(5, 60)
    if rng.random() < 0.5:
        return (f"At a meeting of {n} people, everyone shakes hands once with everyone else. "
                "How many handshakes are there?", Fraction(n * (n - 1) // 2))
    return (f"At a meeting, everyone shook hands once with everyone else, {n * (n - 1) // 2} "
            "handshakes in all. How many people were there?", Fraction(n))


def _marbles(rng: random.Random) -> Problem:
    r, b = rng.randint(2, 12), rng.randint(2, 12)
    return (f"A bag holds {r} red and {b} blue marbles. Two are drawn at random without "
            "replacement. What is the probability that both are red? Give a fraction.",
            Fraction(r * (r - 1), (r + b) * (r + b - 1)))


def _discount(rng: random.Random) -> Problem:
    p, up, down = rng.randint(20, 400), rng.randint(5, 50), rng.randint(5, 50)
    return (f"A jacket costs ${p}. Its price is raised by {up}%, and then the new price is "
            f"cut by {down}%. What is the final price in dollars?",
            Fraction(p * (100 + up) * (100 - down), 10000))


def _pipes(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return (f"One pipe fills a tank in {a} hours and another fills it in {b} hours. How many "
            "hours do they take together?", Fraction(a * b, a + b))


def _ages(rng: random.Random) -> Problem:
    young, gap = rng.randint(3, 40), rng.randint(1, 30)
    old = young + gap
    return (f"The sum of two sisters' ages is {young + old} and their difference is {gap}. "
            "How old is the older sister?", Fraction(old))


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "arith": _arith, "fraction": _fraction, "modpow": _modpow, "lcm": _lcm,
    "divisible": _divisible, "linear": _linear, "system": _system, "roots": _roots,
    "series": _series, "committee": _committee, "podium": _podium, "arrange": _arrange,
    "grid": _grid, "handshake": _handshake, "marbles": _marbles, "discount": _discount,
    "pipes": _pipes, "ages": _ages,
}


class MathSuite(AnswerSuite):
    """Exact-answer math problems; see the module docstring."""

    name = "math"
    answer_hint = "an integer or a fraction such as 7/3"

    def __init__(self, *, kinds: list[str] | None = None, python_tool: bool = True,
                 python_timeout_s: float = 20.0, python_session: bool = False) -> None:
        super().__init__(python_tool=python_tool, python_timeout_s=python_timeout_s,
                         python_session=python_session)
        unknown = sorted(set(kinds or ()) - set(GENERATORS))
        if unknown:
            raise ValueError(f"unknown math kinds {unknown}; choose from {sorted(GENERATORS)}")
        self.kinds = sorted(kinds) if kinds else sorted(GENERATORS)

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` (default 100) problems; task i depends only on (seed, i)."""
        out = []
        for i in range(count(n)):
            rng = rng_for(self.name, seed, i)
            kind = rng.choice(self.kinds)
            question, answer = GENERATORS[kind](rng)
            out.append(self.task_from_record({"id": f"math-{seed}-{i:05d}", "question": question,
                                              "answer": str(answer), "kind": kind}))
        return out

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        check_keys(record, _FIELDS)
        task_id = req_str(record, "id")
        question = req_str(record, "question")
        raw = record.get("answer")
        if isinstance(raw, bool) or not isinstance(raw, str | int | float) or raw == "":
            raise TaskFormatError("field 'answer' must be a non-empty string or a number")
        metadata: dict[str, Any] = {"question": question, "answer": str(raw)}
        if "tolerance" in record:
            metadata["tolerance"] = opt_float(record, "tolerance", 1e-6)
        kind = opt_str(record, "kind")
        if kind is not None:
            metadata["kind"] = kind
        return self._task(task_id, PROMPT.format(question=question), metadata)

    def score_answer(self, task: Task, answer: str | None) -> RewardResult:
        gold = str(task.metadata["answer"])
        if answer is None or not answer.strip():
            return RewardResult(0.0, {"correct": 0.0, "parsed": 0.0}, "no answer")
        predicted = extract_answer(answer)
        tolerance = float(task.metadata.get("tolerance", 1e-6))
        correct = answers_match(predicted, gold, rel_tol=tolerance)
        parsed = float(parse_number(predicted) is not None)
        return RewardResult(float(correct), {"correct": float(correct), "parsed": parsed},
                            f"answer {predicted[:60]!r} vs gold {gold!r}")

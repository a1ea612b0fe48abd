"""`stem`: science questions with numeric (unit, tolerance) or multiple-choice answers.

Generated kinds: kinematics (``speed``, ``distance``, ``fall``), the ideal gas law
(``gas_pressure``, ``gas_volume``), circuits (``series_current``, ``parallel``,
``power``), energy (``kinetic``), chemistry (``stoichiometry``, ``molarity``). A
generated question is multiple-choice with probability 0.4: four options, the
correct value and three values a typical mistake gives (a missed factor of two, a
forgotten unit conversion...), in a seeded order.

Task format, numeric::

    {"id": "q1", "question": "...", "answer": 12.5, "unit": "m/s", "tolerance": 0.01}

``answer`` (number) in ``unit`` (optional; one of `treadle.envs.units.UNITS` or a
quotient of two of them; omit it for a dimensionless answer); ``tolerance``
(optional, default 0.01) is relative. Multiple choice::

    {"id": "q2", "question": "...", "choices": ["4 J", "8 J", "16 J"], "answer": "B"}

``choices`` (2 to 10 strings, shown as A), B)...) and ``answer`` (the letter).
Both may carry ``kind`` (a label).

Reward 1.0 or 0.0. Numeric: the answer's number and unit (any unit of the same
kind: ``0.5 km`` for 500 m; none means the gold's unit) within the tolerance.
Multiple choice: the chosen letter (``B``, ``(B)``, ``\\boxed{B}``, "the answer is
B", or the exact text of a choice).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from treadle.envs.base import RewardResult
from treadle.envs.errors import TaskFormatError
from treadle.envs.records import check_keys, opt_float, opt_str, req_list, req_str, rng_for
from treadle.envs.scoring import extract_answer, extract_boxed, normalize_text
from treadle.envs.suites._answer import AnswerSuite, count
from treadle.envs.units import quantity_matches, to_si
from treadle.types import Task

G = 9.81  # m/s^2, as the questions state
R_GAS = 8.314  # J/(mol K)
MC_PROBABILITY = 0.4
LETTERS = "ABCDEFGHIJ"
# (question, value, unit, distractor values in the same unit)
Generated = tuple[str, float, str, list[float]]

_MASSES = {"H": 1.008, "C": 12.011, "N": 14.007, "O": 15.999, "Na": 22.990, "Cl": 35.45,
           "Mg": 24.305, "Ca": 40.078}
# (equation, reactant, its coefficient, product, its coefficient, the other reactant)
_REACTIONS = (
    ("2 H2 + O2 -> 2 H2O", "H2", 2, "H2O", 2, "O2"),
    ("CH4 + 2 O2 -> CO2 + 2 H2O", "CH4", 1, "CO2", 1, "O2"),
    ("N2 + 3 H2 -> 2 NH3", "H2", 3, "NH3", 2, "N2"),
    ("2 Na + Cl2 -> 2 NaCl", "Na", 2, "NaCl", 2, "Cl2"),
    ("2 Mg + O2 -> 2 MgO", "Mg", 2, "MgO", 2, "O2"),
    ("CaCO3 -> CaO + CO2", "CaCO3", 1, "CO2", 1, "nothing"),
)
_FORMULA = re.compile(r"([A-Z][a-z]?)(\d*)")
PROMPT_NUMERIC = (
    "Answer the following science question. You can run Python code with the `python` "
    "tool. Give the final answer as a number with its unit (for example 12.5 m/s) by "
    "calling `submit_answer`, or end your reply with \\boxed{{...}}. Answers within "
    "{tolerance:g}% are accepted.\n\nQuestion: {question}")
PROMPT_CHOICE = (
    "Answer the following science question. You can run Python code with the `python` "
    "tool. Exactly one choice is correct: call `submit_answer` with its letter, or end your "
    "reply with \\boxed{{letter}}.\n\nQuestion: {question}\n{choices}")


def molar_mass(formula: str) -> float:
    """g/mol of a simple formula such as "CaCO3" (no parentheses)."""
    return sum(_MASSES[el] * int(n or 1) for el, n in _FORMULA.findall(formula))


def _speed(rng: random.Random) -> Generated:
    u, a, t = rng.randint(0, 20), rng.randint(1, 9) / 2, rng.randint(2, 15)
    return (f"A cart moving at {u} m/s accelerates uniformly at {a:g} m/s^2 for {t} s. "
            "What is its final speed?", u + a * t, "m/s", [u + a * t / 2, a * t, u * t + a])


def _distance(rng: random.Random) -> Generated:
    u, a, t = rng.randint(1, 20), rng.randint(1, 9) / 2, rng.randint(2, 15)
    return (f"A cart moving at {u} m/s accelerates uniformly at {a:g} m/s^2 for {t} s. "
            "How far does it travel in that time?", u * t + a * t * t / 2, "m",
            [u * t + a * t * t, (u + a * t) * t, a * t * t / 2])


def _fall(rng: random.Random) -> Generated:
    h = rng.randint(5, 200)
    return (f"A stone is dropped from rest from a height of {h} m. Ignoring air resistance and "
            f"taking g = {G} m/s^2, how long does it take to reach the ground?",
            math.sqrt(2 * h / G), "s", [math.sqrt(h / G), 2 * h / G, h / G])


def _gas_pressure(rng: random.Random) -> Generated:
    n, v, t = rng.randint(1, 20) / 4, rng.randint(5, 100), rng.randint(250, 600)
    pa = n * R_GAS * t / (v / 1000)
    return (f"{n:g} mol of an ideal gas fills a {v} L container at {t} K. What is its "
            f"pressure in kPa? Use R = {R_GAS} J/(mol K).", pa / 1000, "kPa",
            [pa, pa / 1000 * (t - 273.15) / t, n * R_GAS * t / v])


def _gas_volume(rng: random.Random) -> Generated:
    n, p, t = rng.randint(1, 20) / 4, rng.randint(50, 300), rng.randint(250, 600)
    m3 = n * R_GAS * t / (p * 1000)
    return (f"What volume, in litres, do {n:g} mol of an ideal gas occupy at {p} kPa and "
            f"{t} K? Use R = {R_GAS} J/(mol K).", m3 * 1000, "L",
            [m3, m3 * 1e6, n * R_GAS * t / p / 1000])


def _series_current(rng: random.Random) -> Generated:
    r1, r2, v = rng.randint(10, 500), rng.randint(10, 500), rng.randint(3, 24)
    return (f"Resistors of {r1} ohm and {r2} ohm are connected in series to an ideal {v} V "
            "battery. What current flows, in mA?", v / (r1 + r2) * 1000, "mA",
            [v / r1 * 1000 + v / r2 * 1000, v / (r1 + r2), v * (r1 + r2) / 1000])


def _parallel(rng: random.Random) -> Generated:
    r1, r2 = rng.randint(10, 1000), rng.randint(10, 1000)
    return (f"What is the equivalent resistance of a {r1} ohm resistor and a {r2} ohm "
            "resistor connected in parallel?", r1 * r2 / (r1 + r2), "ohm",
            [r1 + r2, (r1 + r2) / 2, abs(r1 - r2) + 1])


def _power(rng: random.Random) -> Generated:
    r, i = rng.randint(2, 200), rng.randint(1, 40) / 10
    return (f"A current of {i:g} A flows through a {r} ohm resistor. How much power does it "
            "dissipate?", i * i * r, "W", [i * r, i * r * r, i * i * r / 2])


def _kinetic(rng: random.Random) -> Generated:
    m, v = rng.randint(1, 80) / 2, rng.randint(2, 40)
    return (f"A {m:g} kg ball moves at {v} m/s. What is its kinetic energy?",
            m * v * v / 2, "J", [m * v * v, m * v / 2, m * v])


def _stoichiometry(rng: random.Random) -> Generated:
    equation, reactant, k_r, product, k_p, other = rng.choice(_REACTIONS)
    grams = rng.randint(2, 200)
    excess = "" if other == "nothing" else f" with excess {other}"
    moles = grams / molar_mass(reactant) * k_p / k_r
    value = moles * molar_mass(product)
    return (f"How many grams of {product} are produced when {grams} g of {reactant} react "
            f"completely{excess}? Reaction: {equation}. Molar masses (g/mol): "
            + ", ".join(f"{el} {m}" for el, m in _MASSES.items()) + ".", value, "g",
            [grams / molar_mass(reactant) * molar_mass(product), moles, value * 2])


def _molarity(rng: random.Random) -> Generated:
    salt = rng.choice(("NaCl", "MgCl2", "CaCl2"))
    grams, ml = rng.randint(1, 60), rng.randint(50, 1000)
    mol = grams / molar_mass(salt)
    return (f"{grams} g of {salt} is dissolved in water to make {ml} mL of solution. What is "
            "its molar concentration in mol/L? Molar masses (g/mol): "
            + ", ".join(f"{el} {_MASSES[el]}" for el in ("Na", "Mg", "Ca", "Cl")) + ".",
            mol / (ml / 1000), "mol/L", [mol / ml, grams / ml, mol * ml / 1000])


GENERATORS: dict[str, Callable[[random.Random], Generated]] = {
    "speed": _speed, "distance": _distance, "fall": _fall, "gas_pressure": _gas_pressure,
    "gas_volume": _gas_volume, "series_current": _series_current, "parallel": _parallel,
    "power": _power, "kinetic": _kinetic, "stoichiometry": _stoichiometry,
    "molarity": _molarity,
}


def fmt(value: float) -> str:
    """Three significant figures, without exponent notation for everyday magnitudes."""
    if value == 0 or not 1e-3 <= abs(value) < 1e7:
        return f"{value:.3g}"
    rounded = float(f"{value:.3g}")  # rounding first: 9.996 becomes 10.0, not 10.00
    digits = max(0, 2 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:.{digits}f}"


def _choice_letter(answer: str, choices: list[str]) -> str | None:
    text = extract_boxed(answer) or extract_answer(answer)
    m = re.fullmatch(r"\W*(?:option|choice)?\s*\(?([A-Ja-j])\)?\W*", text, re.IGNORECASE)
    if m:
        return m.group(1).upper()
    wanted = normalize_text(text)
    for letter, choice in zip(LETTERS, choices, strict=False):
        if wanted and wanted == normalize_text(choice):
            return letter
    return None


class StemSuite(AnswerSuite):
    """Science questions; see the module docstring."""

    name = "stem"
    answer_hint = "a number with its unit, or the letter of a choice"

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` (default 100) questions; task i depends only on (seed, i)."""
        out = []
        kinds = sorted(GENERATORS)
        for i in range(count(n)):
            rng = rng_for(self.name, seed, i)
            kind = rng.choice(kinds)
            question, value, unit, wrong = GENERATORS[kind](rng)
            record: dict[str, Any] = {"id": f"stem-{seed}-{i:05d}", "question": question,
                                      "kind": kind}
            options = [fmt(value)]
            for w in wrong:
                if fmt(w) not in options:
                    options.append(fmt(w))
            if rng.random() < MC_PROBABILITY and len(options) >= 4:
                options = options[:4]
                order = list(range(4))
                rng.shuffle(order)
                record["choices"] = [f"{options[k]} {unit}" for k in order]
                record["answer"] = LETTERS[order.index(0)]
            else:
                record.update(answer=float(f"{value:.6g}"),
                              unit=unit, tolerance=0.01)
            out.append(self.task_from_record(record))
        return out

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        check_keys(record, {"question", "answer", "unit", "tolerance", "choices", "kind"})
        task_id, question = req_str(record, "id"), req_str(record, "question")
        metadata: dict[str, Any] = {"question": question}
        kind = opt_str(record, "kind")
        if kind is not None:
            metadata["kind"] = kind
        if "choices" in record:
            choices = req_list(record, "choices", min_items=2)
            if len(choices) > len(LETTERS) or not all(isinstance(c, str) for c in choices):
                raise TaskFormatError(f"field 'choices' must hold 2 to {len(LETTERS)} strings")
            letter = req_str(record, "answer").strip().upper()
            if letter not in LETTERS[:len(choices)]:
                raise TaskFormatError("field 'answer' must be a choice letter, "
                                      f"A to {LETTERS[len(choices) - 1]}")
            metadata.update(choices=list(choices), answer=letter)
            listing = "\n".join(f"{LETTERS[k]}) {c}" for k, c in enumerate(choices))
            return self._task(task_id, PROMPT_CHOICE.format(question=question, choices=listing),
                              metadata)
        answer = record.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, int | float):
            raise TaskFormatError("field 'answer' must be a number (or give 'choices')")
        unit = opt_str(record, "unit")
        if unit is not None and to_si(1.0, unit) is None:
            raise TaskFormatError(f"field 'unit': unknown unit {unit!r}")
        tolerance = opt_float(record, "tolerance", 0.01)
        metadata.update(answer=float(answer), tolerance=tolerance)
        if unit is not None:
            metadata["unit"] = unit
        prompt = PROMPT_NUMERIC.format(question=question, tolerance=tolerance * 100)
        return self._task(task_id, prompt, metadata)

    def score_answer(self, task: Task, answer: str | None) -> RewardResult:
        meta = task.metadata
        if answer is None or not answer.strip():
            return RewardResult(0.0, {"correct": 0.0}, "no answer")
        if "choices" in meta:
            letter = _choice_letter(answer, meta["choices"])
            ok = letter == meta["answer"]
            return RewardResult(float(ok), {"correct": float(ok)},
                                f"chose {letter} vs gold {meta['answer']}")
        text = extract_answer(answer)
        ok, why = quantity_matches(text, meta["answer"], meta.get("unit", ""), meta["tolerance"])
        return RewardResult(float(ok), {"correct": float(ok)}, why)

"""The math and stem suites: generation, task formats, rewards, episodes in a sandbox."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
from envs_helpers import Backend, play, run

from treadle.envs import TaskFormatError, get_suite
from treadle.envs.suites.math import GENERATORS, MathSuite
from treadle.envs.suites.stem import StemSuite, fmt, molar_mass
from treadle.types import Task

MATH = MathSuite()
STEM = StemSuite()


def test_math_generates_every_kind_with_exact_answers() -> None:
    tasks = MATH.tasks(300, seed=3)
    assert {t.metadata["kind"] for t in tasks} == set(GENERATORS)
    assert len({t.task_id for t in tasks}) == 300
    for t in tasks:
        assert t.suite == "math" and t.metadata["question"] in str(t.prompt)
        assert Fraction(t.metadata["answer"]) is not None  # str(Fraction): exact


def _coef(text: str) -> int:
    if text in ("", "-"):
        return -1 if text else 1
    return int(text)


def test_math_answers_are_right() -> None:
    # Recompute some kinds from the question text alone.
    checked = 0
    for t in MATH.tasks(300, seed=3):
        q, answer = t.metadata["question"], Fraction(t.metadata["answer"])
        m = re.fullmatch(r"Solve for x: (-?\d*)x ([+-]) (\d+) = (-?\d*)x ([+-]) (\d+)\.", q)
        if m:
            a, c = _coef(m.group(1)), _coef(m.group(4))
            b = int(m.group(3)) * (-1 if m.group(2) == "-" else 1)
            d = int(m.group(6)) * (-1 if m.group(5) == "-" else 1)
            assert a * answer + b == c * answer + d, q
            checked += 1
        m = re.fullmatch(r"Compute (\d+) \* (\d+) - (\d+) \* (\d+)\.", q)
        if m:
            a, b, c, d = map(int, m.groups())
            assert answer == a * b - c * d, q
            checked += 1
        m = re.fullmatch(r"A club with (\d+) members chooses a committee of (\d+)\..*", q)
        if m:
            assert answer == math.comb(int(m.group(1)), int(m.group(2))), q
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("seed", [0, 1])
def test_math_reward_on_known_good_and_bad_answers(seed: int) -> None:
    for task in MATH.tasks(60, seed=seed):
        gold = task.metadata["answer"]
        value = Fraction(gold)
        good = [gold, f"\\boxed{{{gold}}}", f"The answer is {gold}.", f"x = {gold}",
                f"{float(value):.12f}"]
        if value.denominator != 1:
            good.append(f"\\frac{{{value.numerator}}}{{{value.denominator}}}")
        else:
            good.append(f"{int(value):,}")
        for answer in good:
            assert MATH.score_answer(task, answer).reward == 1.0, (task.metadata, answer)
        for answer in (str(value + 1), f"\\boxed{{{value * 2 + 1}}}", "I don't know", "", None):
            assert MATH.score_answer(task, answer).reward == 0.0, (task.metadata, answer)


def test_math_user_records(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": "a", "question": "1/3 as a decimal?", "answer": "0.3333", '
                    '"tolerance": 0.001}\n\n{"id": "b", "question": "2+2", "answer": 4}\n')
    a, b = MATH.load_tasks(path)
    assert MATH.score_answer(a, "1/3").reward == 1.0
    assert MATH.score_answer(a, "0.3335").reward == 1.0
    assert MATH.score_answer(a, "0.334").reward == 0.0
    assert b.metadata["answer"] == "4" and MATH.score_answer(b, "4.0").reward == 1.0
    for bad, field in (('{"id": "a", "question": "q"}', "answer"),
                       ('{"id": "a", "answer": "1"}', "question"),
                       ('{"id": "a", "question": "q", "answer": "1", "answr": 2}', "answr"),
                       ('{"id": "a", "question": "q", "answer": true}', "answer"),
                       ("[1]", "JSON object"), ("{not json", "not JSON")):
        path.write_text(bad + "\n")
        with pytest.raises(TaskFormatError, match=field):
            MATH.load_tasks(path)
    path.write_text('{"id": "a", "question": "q", "answer": 1}\n' * 2)
    with pytest.raises(TaskFormatError, match=r"m.jsonl:2: duplicate id"):
        MATH.load_tasks(path)


def test_stem_generates_numeric_and_multiple_choice() -> None:
    tasks = STEM.tasks(200, seed=0)
    choice = [t for t in tasks if "choices" in t.metadata]
    numeric = [t for t in tasks if "unit" in t.metadata]
    assert 40 < len(choice) < 120 and len(choice) + len(numeric) == 200
    for t in choice:
        options = t.metadata["choices"]
        assert len(options) == 4 and len(set(options)) == 4
        assert "A) " in str(t.prompt) and "D) " in str(t.prompt)


def test_stem_physics_and_chemistry_values() -> None:
    assert molar_mass("H2O") == pytest.approx(18.015)
    assert molar_mass("CaCO3") == pytest.approx(100.086)
    assert fmt(0.0227) == "0.0227" and fmt(1234.5) == "1230" and fmt(9.996) == "10.0"
    by_kind = {t.metadata["kind"]: t.metadata for t in STEM.tasks(200, seed=0)
               if "unit" in t.metadata}
    q = by_kind["kinetic"]
    numbers = [float(w) for w in q["question"].replace("kg", " ").split() if
               w.replace(".", "").isdigit()]
    m, v = numbers[:2]
    assert q["answer"] == pytest.approx(m * v * v / 2, rel=1e-5)


@pytest.mark.parametrize("seed", [0, 7])
def test_stem_reward_on_known_good_and_bad_answers(seed: int) -> None:
    for task in STEM.tasks(60, seed=seed):
        meta = task.metadata
        if "choices" in meta:
            letter = meta["answer"]
            wrong = next(x for x in "ABCD" if x != letter)
            text = meta["choices"]["ABCD".index(letter)]
            for answer in (letter, f"({letter})", f"\\boxed{{{letter}}}",
                           f"The answer is {letter}.", text):
                assert STEM.score_answer(task, answer).reward == 1.0, (meta, answer)
            for answer in (wrong, "E", "no idea", None):
                assert STEM.score_answer(task, answer).reward == 0.0, (meta, answer)
        else:
            value, unit = meta["answer"], meta["unit"]
            for answer in (f"{value} {unit}", f"{value}", f"\\boxed{{{value * 1.004}\\,{unit}}}"):
                assert STEM.score_answer(task, answer).reward == 1.0, (meta, answer)
            for answer in (f"{value * 1.05} {unit}", f"{value} furlongs", "", None):
                assert STEM.score_answer(task, answer).reward == 0.0, (meta, answer)


def test_stem_user_records() -> None:
    numeric = STEM.task_from_record({"id": "n", "question": "How far?", "answer": 1.5,
                                     "unit": "km", "tolerance": 0.001})
    assert STEM.score_answer(numeric, "1500 m").reward == 1.0
    assert STEM.score_answer(numeric, "1.51 km").reward == 0.0
    unitless = STEM.task_from_record({"id": "u", "question": "Ratio?", "answer": 0.25})
    assert STEM.score_answer(unitless, "0.25").reward == 1.0
    mc = STEM.task_from_record({"id": "c", "question": "Pick", "choices": ["x", "y"],
                                "answer": "b"})
    assert mc.metadata["answer"] == "B" and STEM.score_answer(mc, "y").reward == 1.0
    for bad, fragment in (({"question": "q", "answer": 1, "unit": "parsec-ish"}, "unit"),
                          ({"question": "q", "choices": ["a"], "answer": "A"}, "choices"),
                          ({"question": "q", "choices": ["a", "b"], "answer": "C"}, "letter"),
                          ({"question": "q", "answer": "five"}, "number")):
        with pytest.raises(TaskFormatError, match=fragment):
            STEM.task_from_record({"id": "x", **bad})


@pytest.mark.integration
def test_math_end_to_end_in_a_sandbox(sandbox_backend: Backend) -> None:
    suite = get_suite("math")
    for task in suite.tasks(2, seed=11):
        value = Fraction(task.metadata["answer"])
        code = f"from fractions import Fraction\nprint(Fraction({value.numerator}, " \
               f"{value.denominator}))"

        async def solve(task: Task, code: str, wrong: str) -> tuple[float, float]:
            _, results = await play(suite, task, sandbox_backend.backend,
                                    [("python", {"code": code})])
            assert results[0].ok, (sandbox_backend.label(), results[0])
            good, results = await play(suite, task, sandbox_backend.backend, [
                ("python", {"code": code}),
                ("submit_answer", {"answer": results[0].output.strip()})])
            bad, _ = await play(suite, task, sandbox_backend.backend,
                                [("submit_answer", {"answer": wrong})])
            return good.reward, bad.reward

        good, bad = run(solve(task, code, str(value + 1)))
        assert good == 1.0, (sandbox_backend.label(), task.metadata)
        assert bad < 1.0, (sandbox_backend.label(), task.metadata)


@pytest.mark.integration
def test_stem_end_to_end_in_a_sandbox(sandbox_backend: Backend) -> None:
    suite = get_suite("stem")
    tasks = suite.tasks(40, seed=5)
    picked = [next(t for t in tasks if "choices" in t.metadata),
              next(t for t in tasks if "unit" in t.metadata)]
    for task in picked:
        meta = task.metadata
        if "choices" in meta:
            right, wrong = meta["answer"], next(x for x in "ABCD" if x != meta["answer"])
        else:
            right = f"{meta['answer']} {meta['unit']}"
            wrong = f"{meta['answer'] * 2} {meta['unit']}"

        async def solve(task: Task, right: str, wrong: str) -> tuple[float, float]:
            good, results = await play(suite, task, sandbox_backend.backend, [
                ("python", {"code": f"print({right!r})"}),
                ("submit_answer", {"answer": right})])
            assert results[0].output == right, (sandbox_backend.label(), results)
            # no submit_answer: the final message is scored
            bad, _ = await play(suite, task, sandbox_backend.backend, [],
                                final_message=f"I think it is \\boxed{{{wrong}}}.")
            return good.reward, bad.reward

        good, bad = run(solve(task, right, wrong))
        assert (good, bad) == (1.0, 0.0), (sandbox_backend.label(), meta)

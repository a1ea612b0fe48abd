"""The code suite: bundled problems, hidden tests in the sandbox, partial credit, cheating."""

from __future__ import annotations

from typing import Any

import pytest
from envs_helpers import Backend, play, run

from treadle.envs import TaskFormatError, get_suite
from treadle.envs.suites._code_bank import PROBLEMS
from treadle.envs.suites.code import CodeSuite, values_equal
from treadle.types import Task

SUITE = CodeSuite()


def test_bundle_has_twenty_problems_with_hidden_tests() -> None:
    tasks = SUITE.tasks()
    assert len(tasks) == len(PROBLEMS) == 20
    assert len({t.metadata["entry_point"] for t in tasks}) == 20
    for t in tasks:
        tests = t.metadata["tests"]
        assert len(tests) >= 9, t.task_id
        assert "solution" in t.metadata and t.metadata["solution"] not in str(t.prompt)
        assert f"`{t.metadata['entry_point']}`" in str(t.prompt)
        # the prompt shows the first two tests as examples, no more
        calls = [f"{t.metadata['entry_point']}({', '.join(map(repr, x['args']))}) == "
                 for x in tests]
        shown = str(t.prompt).replace(t.metadata["problem"], "")  # statements have examples
        assert calls[0] in shown and calls[1] in shown
        assert not any(c in shown for c in calls[2:] if c not in calls[:2])


def test_values_equal() -> None:
    assert values_equal([1, [2.0000000001]], [1, [2.0]])
    assert values_equal({"a": 1}, {"a": 1}) and not values_equal({"a": 1}, {"a": 1, "b": 2})
    assert not values_equal(True, 1) and not values_equal(1, True)
    assert not values_equal("1", 1) and not values_equal([1, 2], [1])
    assert not values_equal(None, 0) and values_equal(None, None)


def test_task_format_is_checked() -> None:
    good = {"id": "c", "problem": "Add.", "entry_point": "add",
            "tests": [{"args": [1, 2], "expected": 3},
                      {"args": [], "kwargs": {"a": 1, "b": 2}, "expected": 3}]}
    task = SUITE.task_from_record(good)
    assert "add(1, 2) == 3" in str(task.prompt)
    assert SUITE.task_to_record(task) == good
    for broken, fragment in (({"entry_point": "not valid"}, "identifier"),
                             ({"tests": []}, "tests"),
                             ({"tests": [{"args": [1]}]}, "expected"),
                             ({"tests": [{"args": 1, "expected": 1}]}, "args"),
                             ({"examples": -1}, "examples"), ({"time_limit_s": 0}, "time_limit"),
                             ({"problem": ""}, "problem")):
        with pytest.raises(TaskFormatError, match=fragment):
            SUITE.task_from_record({**good, **broken})


def grade(backend: Backend, task: Task, source: str | None,
          calls: list[tuple[str, dict[str, Any]]] | None = None) -> tuple[float, str]:
    steps = list(calls or [])
    if source is not None:
        steps.insert(0, ("write_file", {"path": "solution.py", "content": source}))
    result, _ = run(play(SUITE, task, backend.backend, steps))
    return result.reward, result.detail


@pytest.mark.integration
def test_every_reference_solution_passes_its_hidden_tests(sandbox_backend: Backend) -> None:
    for task in SUITE.tasks():
        reward, detail = grade(sandbox_backend, task, task.metadata["solution"])
        assert reward == 1.0, (sandbox_backend.label(), task.task_id, detail)


@pytest.mark.integration
def test_code_end_to_end_good_bad_and_partial(sandbox_backend: Backend) -> None:
    suite = get_suite("code")
    for task in suite.tasks(2, seed=4):
        entry, solution = task.metadata["entry_point"], task.metadata["solution"]
        first_args = task.metadata["tests"][0]["args"]
        good, _ = run(play(suite, task, sandbox_backend.backend, [
            ("write_file", {"path": "solution.py", "content": solution}),
            ("python", {"code": f"from solution import {entry}\nprint({entry}(*{first_args!r}))"}),
            ("submit_answer", {"answer": "done"})]))
        assert good.reward == 1.0, (sandbox_backend.label(), task.task_id, good)
        bad, _ = run(play(suite, task, sandbox_backend.backend, [
            ("write_file", {"path": "solution.py", "content": f"def {entry}(*a, **k):\n"
                                                              "    return None\n"}),
            ("submit_answer", {"answer": "done"})]))
        assert bad.reward < 1.0, (sandbox_backend.label(), task.task_id, bad)
    # partial credit: right on the first test only
    task = SUITE.task_from_record({
        "id": "p", "problem": "Double it.", "entry_point": "double",
        "tests": [{"args": [1], "expected": 2}, {"args": [2], "expected": 4},
                  {"args": [5], "expected": 10}, {"args": [0], "expected": 0}]})
    reward, detail = grade(sandbox_backend, task, "def double(x):\n    return x + 1 if x == 1 "
                                                  "else x * 2 + 1\n")
    assert reward == 0.25 and detail.startswith("1/4"), (sandbox_backend.label(), detail)


@pytest.mark.integration
def test_submitted_code_block_is_graded_and_missing_file_scores_zero(
        sandbox_backend: Backend) -> None:
    task = next(t for t in SUITE.tasks() if t.metadata["entry_point"] == "digital_root")
    answer = f"Here it is:\n```python\n{task.metadata['solution']}```\n"
    reward, _ = grade(sandbox_backend, task, None, [("submit_answer", {"answer": answer})])
    assert reward == 1.0, sandbox_backend.label()
    reward, detail = grade(sandbox_backend, task, None, [("submit_answer", {"answer": "ok"})])
    assert reward == 0.0 and "no usable solution.py" in detail, (sandbox_backend.label(), detail)
    # a symlink planted instead of the file is the agent's doing, not an infrastructure error
    reward, detail = grade(sandbox_backend, task, None, [
        ("bash", {"command": "ln -s /etc/passwd solution.py"})])
    assert reward == 0.0 and "symlink" in detail, (sandbox_backend.label(), detail)
    # no submit_answer: a code block in the final message counts
    result, _ = run(play(SUITE, task, sandbox_backend.backend, [],
                         final_message=f"```python\n{task.metadata['solution']}```"))
    assert result.reward == 1.0, (sandbox_backend.label(), result)


@pytest.mark.integration
def test_cheating_and_broken_solutions_earn_nothing(sandbox_backend: Backend) -> None:
    bundled = next(t for t in SUITE.tasks() if t.metadata["entry_point"] == "pascal_row")
    # a short per-test limit keeps the hanging case fast
    record = SUITE.task_to_record(bundled)
    task = SUITE.task_from_record({**record, "tests": record["tests"][:4], "time_limit_s": 0.3})
    honest = sum(t["expected"] == [1] for t in record["tests"][:4]) / 4  # what [1] earns
    cheats = {
        # fake result lines: the nonce is unknown and expected values never enter the sandbox
        "fake": "for i in range(50):\n"
                "    print('@@x@@{\"i\": %d, \"value\": [1]}' % i)\n"
                "def pascal_row(n):\n    return [1]\n",
        # frame inspection finds the harness's spec: it holds inputs, never expected outputs
        "peek": "import sys\nf, spec = sys._getframe(), {}\nwhile f is not None:\n"
                "    spec = f.f_locals.get('spec') or spec\n    f = f.f_back\n"
                "found = iter(spec.get('expected', []))\n"
                "def pascal_row(n):\n    return next(found, None)\n",
        "exit": "import os\nos._exit(0)\n",
        "syntax": "def pascal_row(n)\n    return [1]\n",
        "hang": "def pascal_row(n):\n    while True:\n        pass\n",
        "crash": "def pascal_row(n):\n    raise SystemExit(0)\n",
    }
    for name, source in cheats.items():
        reward, detail = grade(sandbox_backend, task, source)
        limit = honest if name == "fake" else 0.0
        assert reward <= limit, (sandbox_backend.label(), name, detail)
    reward, detail = grade(sandbox_backend, task, cheats["syntax"])
    assert "failed to load: SyntaxError" in detail, detail

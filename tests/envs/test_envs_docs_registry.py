"""The registry, and docs/suites.md's worked example, executed as written."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from envs_helpers import Backend, run

from treadle.envs import (
    EnvConfigError,
    Suite,
    get_suite,
    register_suite,
    suite_names,
    unregister_suite,
)
from treadle.envs.suites.math import MathSuite

DOC = Path(__file__).resolve().parents[2] / "docs" / "suites.md"
BUILTIN = ["code", "gym_text", "math", "nemo_gym", "search", "stem", "swe", "swe-images"]


def test_builtin_suites_by_name() -> None:
    assert suite_names() == BUILTIN
    for name in ("math", "code", "swe", "search", "stem"):
        suite = get_suite(name)
        assert isinstance(suite, Suite) and suite.name == name
        [task] = suite.tasks(1, seed=0)
        assert task.suite == name and task.prompt
    assert get_suite("search", python_tool=False).tools(get_suite("search").tasks(1)[0])
    with pytest.raises(EnvConfigError, match=r"unknown suite 'nope'.*math"):
        get_suite("nope")
    with pytest.raises(EnvConfigError, match="suite 'math'"):
        get_suite("math", colour="blue")


def test_register_and_replace() -> None:
    register_suite("my-math", MathSuite)
    try:
        assert "my-math" in suite_names() and isinstance(get_suite("my-math"), MathSuite)
        with pytest.raises(EnvConfigError, match="already exists"):
            register_suite("my-math", MathSuite)
        with pytest.raises(EnvConfigError, match="already exists"):
            register_suite("math", MathSuite)
        register_suite("my-math", lambda: MathSuite(kinds=["arith"]), replace=True)
        assert get_suite("my-math").tasks(1)[0].metadata["kind"] == "arith"
        with pytest.raises(ValueError):
            register_suite("bad name!", MathSuite)
    finally:
        unregister_suite("my-math")
    assert "my-math" not in suite_names()


def doc_example_blocks() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Adding a suite"):]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


@pytest.fixture
def doc_namespace() -> Iterator[dict[str, Any]]:
    blocks = doc_example_blocks()
    assert len(blocks) == 2, "the worked example has a definition block and a usage block"
    namespace: dict[str, Any] = {"__name__": "docs_suites_example"}
    try:
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
        yield namespace
    finally:
        unregister_suite("countdown")


def test_doc_example_reward_and_format(doc_namespace: dict[str, Any]) -> None:
    suite = get_suite("countdown")
    assert type(suite).__name__ == "CountdownSuite"
    tasks = suite.tasks(20, seed=3)
    assert tasks == suite.tasks(20, seed=3) and tasks != suite.tasks(20, seed=4)
    context = doc_namespace["ToolContext"]
    for task in tasks:
        numbers, target = task.metadata["numbers"], task.metadata["target"]

        def score(answer: str, task: Any = task) -> float:
            ctx = context(task=task, final_answer=answer)
            return float(run(suite.reward(ctx, None)).reward)

        assert score(task.metadata["solution"]) == 1.0
        assert score(f"{target} + 0") == 0.0 or (target in numbers and 0 in numbers)
        assert score(f"{numbers[0]} * {numbers[0]} * {numbers[0]}") == 0.0 or \
            numbers.count(numbers[0]) >= 3
        assert score("__import__('os')") == 0.0
        assert score("1 / 0") == 0.0 and score("") == 0.0


@pytest.mark.integration
def test_doc_example_runs_end_to_end(doc_namespace: dict[str, Any],
                                     sandbox_backend: Backend) -> None:
    reward = run(doc_namespace["main"](sandbox_backend.backend))
    assert reward == 1.0, sandbox_backend.label()

"""The gymnasium-style adapter, with a tiny text env written here."""

from __future__ import annotations

import random
import threading
from typing import Any, ClassVar

import pytest
from envs_helpers import play, run

from treadle.envs import TaskFormatError, get_suite
from treadle.envs.adapters.gym_text import GymTextSuite


class GuessEnv:
    """Guess a number in 1..20; hints "higher"/"lower"; reward 1 on a hit, -0.1 per miss."""

    closed: ClassVar[list[GuessEnv]] = []

    def __init__(self, max_steps: int = 6) -> None:
        self.max_steps = max_steps
        self.secret = 0
        self.steps = 0
        self.thread: int | None = None

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        high = (options or {}).get("high", 20)
        self.secret = random.Random(seed).randint(1, high)
        self.steps = 0
        self.thread = threading.get_ident()
        return f"I picked a number from 1 to {high}. Guess it.", {"high": high}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not action.strip().isdigit():
            raise ValueError(f"{action!r} is not a number")
        if action.strip() == "666":
            raise RuntimeError("the env itself broke")
        self.steps += 1
        guess = int(action)
        if guess == self.secret:
            return "correct!", 1.0, True, False, {}
        hint = "higher" if guess < self.secret else "lower"
        return hint, -0.1, False, self.steps >= self.max_steps, {}

    def close(self) -> None:
        GuessEnv.closed.append(self)


def solve_calls(low: int, high: int, secret: int) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    while True:
        guess = (low + high) // 2
        calls.append(("act", {"action": str(guess)}))
        if guess == secret:
            return calls
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)


def test_tasks_are_seeded_and_records_checked() -> None:
    suite = GymTextSuite(GuessEnv)
    assert suite.tasks(5, seed=1) == suite.tasks(5, seed=1)
    assert suite.tasks(5, seed=1) != suite.tasks(5, seed=2)
    assert len(suite.tasks()) == 10
    task = suite.task_from_record({"id": "e", "seed": 3, "options": {"high": 50},
                                   "instructions": "Find the number."})
    assert task.prompt == "Find the number." and suite.task_to_record(task)["seed"] == 3
    for bad in ({"id": "e", "seed": "3"}, {"id": "e", "options": [1]}, {"id": "e", "x": 1}):
        with pytest.raises(TaskFormatError):
            suite.task_from_record(bad)
    assert [t["function"]["name"] for t in suite.episode(task).tool_specs] == ["act"]


def test_binary_search_wins_and_wrong_guesses_lose() -> None:
    suite = get_suite("gym_text", make_env=GuessEnv)
    for task in suite.tasks(2, seed=0):
        secret = random.Random(task.metadata["seed"]).randint(1, 20)
        calls = solve_calls(1, 20, secret)

        good, results = run(play(suite, task, None, [*calls, ("act", {"action": "1"})]))
        assert results[-2].done and results[-2].output == "correct!"
        assert results[-1].error is not None and "episode is over" in results[-1].error
        assert good.reward == pytest.approx(1.0 - 0.1 * (len(calls) - 1))
        assert good.metrics == {"terminated": 1.0, "truncated": 0.0, "steps": float(len(calls))}
        wrong = str(21 - secret) if 21 - secret != secret else str(secret % 20 + 1)
        bad, results = run(play(suite, task, None, [("act", {"action": wrong})] * 6))
        assert bad.reward == pytest.approx(-0.6) and bad.metrics["truncated"] == 1.0
        assert results[-1].done


def test_invalid_actions_are_observations_and_env_failures_raise() -> None:
    suite = GymTextSuite(GuessEnv)
    task = suite.tasks(1)[0]
    before = len(GuessEnv.closed)
    result, outputs = run(play(suite, task, None, [("act", {"action": "ten"}),
                                                   ("act", {"guess": "3"})]))
    assert outputs[0].error is not None and "not a number" in outputs[0].error
    assert outputs[1].error is not None and "unknown argument" in outputs[1].error
    assert result.metrics["steps"] == 0.0 and len(GuessEnv.closed) == before + 1
    with pytest.raises(RuntimeError, match="broke"):
        run(play(suite, task, None, [("act", {"action": "666"})]))
    assert len(GuessEnv.closed) == before + 2  # closed even when the env failed


def test_env_code_runs_off_the_event_loop() -> None:
    envs: list[GuessEnv] = []

    def make() -> GuessEnv:
        env = GuessEnv()
        envs.append(env)
        return env

    suite = GymTextSuite(make)
    loop_thread = threading.get_ident()
    run(play(suite, suite.tasks(1)[0], None, [("act", {"action": "5"})]))
    assert envs and envs[0].thread is not None and envs[0].thread != loop_thread

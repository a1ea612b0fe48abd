"""Episodes: dispatch, recording, the end of an episode, sandboxes from backends and pools."""

from __future__ import annotations

import json

import pytest
from envs_helpers import TEST_LIMITS, Backend, run

from treadle.envs import EnvConfigError, get_suite, open_episode
from treadle.envs.suites.math import MathSuite
from treadle.sandbox import PoolSettings, SandboxPool
from treadle.types import ToolCall

MATH = MathSuite(python_tool=False)


def test_calls_are_dispatched_recorded_and_end_with_the_answer() -> None:
    task = MATH.tasks(1, seed=0)[0]

    async def go() -> None:
        async with open_episode(MATH, task) as ep:
            assert [s["function"]["name"] for s in ep.tool_specs] == ["submit_answer"]
            unknown = await ep.call("python", {"code": "1"})
            assert unknown.error == "unknown tool 'python'; available tools: submit_answer"
            not_json = await ep.call("submit_answer", '{"answer": ')
            assert not_json.error is not None and "not valid JSON" in not_json.error
            not_object = await ep.call("submit_answer", "[1, 2]")
            assert not_object.error == "arguments must be a JSON object"
            assert not ep.done
            done = await ep.call("submit_answer",
                                 json.dumps({"answer": task.metadata["answer"]}))
            assert done.ok and ep.done and ep.final_answer == task.metadata["answer"]
            late = await ep.call("submit_answer", {"answer": "0"})
            assert late.error is not None and "episode is over" in late.error
            assert ep.final_answer == task.metadata["answer"]
            assert [r.call_id for r in ep.history] == [f"call_{i}" for i in range(5)]
            assert ep.history[1].arguments == {"_raw": '{"answer": '}
            calls = ep.tool_calls
            assert all(isinstance(c, ToolCall) and c.latency_s >= 0 for c in calls)
            assert [c.error is None for c in calls] == [False, False, False, True, False]
            assert (await ep.score()).reward == 1.0

    run(go())


def test_the_final_message_is_scored_when_nothing_was_submitted() -> None:
    task = MATH.tasks(1, seed=0)[0]

    async def go() -> tuple[float, float]:
        async with open_episode(MATH, task) as ep:
            good = await ep.score(f"So the result is \\boxed{{{task.metadata['answer']}}}.")
            bad = await ep.score("I give up.")
            return good.reward, bad.reward

    assert run(go()) == (1.0, 0.0)


def test_suites_that_run_code_refuse_to_start_without_a_sandbox() -> None:
    suite = get_suite("code")
    task = suite.tasks(1)[0]
    with pytest.raises(EnvConfigError, match="needs a sandbox"):
        suite.episode(task)

    async def go() -> None:
        async with open_episode(suite, task):
            pass

    with pytest.raises(EnvConfigError, match="backend or pool"):
        run(go())


@pytest.mark.integration
def test_episodes_borrow_from_a_pool_and_give_back(sandbox_backend: Backend) -> None:
    suite = get_suite("swe")
    tasks = suite.tasks(2, seed=0)

    async def go() -> None:
        async with SandboxPool(sandbox_backend.backend, TEST_LIMITS,
                               PoolSettings(max_live=2)) as pool:
            for task in tasks:
                async with open_episode(suite, task, pool) as ep:
                    listing = await ep.call("bash", {"command": "ls"})
                    assert "tests" in listing.output, (sandbox_backend.label(), listing)
                    assert pool.stats().in_use == 1
            assert pool.stats().in_use == 0

    run(go())

"""A trajectory whose sandbox cleanup fails keeps its status and reward: a failed
teardown must not turn a finished, scored episode into an excluded one (a policy
could learn to escape a low reward by breaking its cleanup)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agent_helpers import FakeScriptedRunner, build_tokenizer

from treadle.agent.chat import Call, HermesFormat
from treadle.envs.suites.math import MathSuite
from treadle.runtime.rollout import run_task
from treadle.sandbox import Limits, LocalBackend, Sandbox, SandboxBackend
from treadle.testing import FakeClock
from treadle.types import GroupKey, TrajectoryStatus


class FakeBreakingBackend(SandboxBackend):
    """Local sandboxes whose `close` cleans up, then raises what a broken cleanup
    raised before treadle's cleanup was made iterative (a RecursionError)."""

    name = "fake-breaking"

    def __init__(self, root: Path) -> None:
        self.inner = LocalBackend(work_root=str(root))
        self.closed = 0

    async def start(self, limits: Limits) -> Sandbox:
        sandbox = await self.inner.start(limits)
        original = sandbox.close

        async def close() -> None:
            await original()
            self.closed += 1
            raise RecursionError("maximum recursion depth exceeded")

        sandbox.close = close  # type: ignore[method-assign]
        return sandbox


def test_a_failing_cleanup_leaves_a_scored_trajectory_as_it_was(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    suite = MathSuite()  # its python tool needs a sandbox, which the episode then closes
    task = suite.tasks(1, seed=0)[0]
    reply = HermesFormat().reply_text("", [Call.of("submit_answer",
                                                      {"answer": task.metadata["answer"]})])
    runner = FakeScriptedRunner(tok, [reply])
    clock = FakeClock()
    runtime: Any = SimpleNamespace(clock=clock, turns=lambda _tid, _gid, _kv, **_kw: runner)
    backend = FakeBreakingBackend(tmp_path / "work")

    traj = asyncio.run(asyncio.wait_for(run_task(
        runtime, suite, task, traj_id="t0", key=GroupKey(task.task_id, 0), tokenizer=tok,
        sandboxes=backend), 60))
    assert backend.closed == 1
    assert traj.status is TrajectoryStatus.COMPLETED and traj.reward == 1.0
    assert traj.failure_stage is None

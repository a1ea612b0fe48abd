"""A trajectory running in a runner actor, as the service sees it (`RemoteTrajectory`),
without Ray: what its actor says of a suite task's resume and work tree reaches the
attempt's journal and the capture its rubric's judges read, and its record its
`result`."""

from __future__ import annotations

import asyncio

from runtime_helpers import FakeManualScheduler

from treadle.envs.worktree import WorkTree, WorkTreeCapture
from treadle.runtime.driver import Runtime
from treadle.runtime.remote_trajectory import RemoteTrajectory
from treadle.runtime.runner_wire import Captured, Finished, Journaled, Resumed, ToRunner
from treadle.types import (
    GroupKey,
    KVAcrossUpdates,
    ResumePoint,
    Trajectory,
    TrajectoryStatus,
)


class _Journal:
    def __init__(self) -> None:
        self.turns: list[tuple[int, int, bytes]] = []
        self.points: list[ResumePoint] = []

    def sampled(self, tokens: int) -> None:
        pass

    def turn_body(self, index: int, tokens: int, body: bytes) -> None:
        self.turns.append((index, tokens, body))

    def resumed(self, point: ResumePoint) -> None:
        self.points.append(point)


def test_a_tasks_resume_and_work_tree_reach_its_journal_and_capture() -> None:
    tree = WorkTree({"a.py": "x = 1\n"}, {"a.py": "x = 2\n"})
    point = ResumePoint(1, 2, 0, 1, 40, "")
    record = Trajectory("t", GroupKey("g", 0), status=TrajectoryStatus.COMPLETED, attempt=1)

    async def go() -> tuple[_Journal, WorkTreeCapture, Trajectory | str, list[ToRunner]]:
        sent: list[ToRunner] = []
        journal, capture = _Journal(), WorkTreeCapture()
        traj = RemoteTrajectory(sent.append, Runtime(FakeManualScheduler()), "t",
                                KVAcrossUpdates.RECOMPUTE, journal, capture)
        for m in (Resumed("t", point), Journaled("t", 2, 9, b"body"),
                  Captured("t", tree, None), Finished("t", record)):
            traj.hear(m)
        return journal, capture, await traj.result, sent

    journal, capture, result, sent = asyncio.run(go())
    assert journal.points == [point] and journal.turns == [(2, 9, b"body")]
    assert capture.tree == tree and capture.error is None
    assert capture.diff(10_000) == tree.diff(10_000) != ""
    assert result is record and sent == []


def test_a_work_tree_that_could_not_be_read_says_why_to_the_judges() -> None:
    async def go() -> WorkTreeCapture:
        capture = WorkTreeCapture()
        traj = RemoteTrajectory(lambda _: None, Runtime(FakeManualScheduler()), "t",
                                KVAcrossUpdates.RECOMPUTE, None, capture)
        traj.hear(Captured("t", None, "SandboxError: gone"))
        return capture

    capture = asyncio.run(go())
    assert capture.tree is None
    assert "SandboxError: gone" in capture.diff(10_000)

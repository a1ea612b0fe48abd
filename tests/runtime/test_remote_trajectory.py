"""A trajectory running in a runner actor, as the service sees it (`RemoteTrajectory`),
without Ray: what its actor says of a suite task's resume and work tree reaches the
attempt's journal and the capture its rubric's judges read, and its record its
`result`; a driven trajectory's turns (`RemoteTurns`, a gateway session's) go to its
actor in order, their replies come back, and its actor lost fails them."""

from __future__ import annotations

import asyncio

from runtime_helpers import FakeManualScheduler, until

from treadle.agent.runner import Sampling, TurnOutput
from treadle.engines.errors import EngineUnavailable
from treadle.envs.worktree import WorkTree, WorkTreeCapture
from treadle.runtime.driver import Runtime
from treadle.runtime.remote_trajectory import RemoteTrajectory, RemoteTurns
from treadle.runtime.runner_channel import RunnerChannel
from treadle.runtime.runner_wire import (
    CancelCall,
    Captured,
    Done,
    Finished,
    Generate,
    Generated,
    Journaled,
    Resumed,
    ToolBegan,
    ToolDone,
    ToRunner,
    TurnDone,
    TurnsEnded,
)
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


def test_a_driven_trajectorys_turns_go_to_its_actor_and_their_replies_come_back() -> None:
    out = TurnOutput([7, 8], [-0.1, -0.2], [3, 3], "stop", "e1", 0.1, 0.2)

    async def go() -> tuple[list[ToRunner], TurnOutput, list[str]]:
        sent: list[ToRunner] = []
        rt = Runtime(FakeManualScheduler())
        traj = RemoteTrajectory(sent.append, rt, "t", KVAcrossUpdates.RECOMPUTE, None)
        turns = RemoteTurns(traj, sent.append, rt)
        first = asyncio.ensure_future(turns.generate([1, 2], 16, Sampling(), [9]))
        await until(lambda: bool(traj.calls))
        traj.hear(Generated("t", 1, out))
        got = await first
        turns.turn_finished(2, 4, False)
        turns.tool_started()
        turns.tool_finished(0.5, 3, False)
        gave_up = asyncio.ensure_future(turns.generate([1, 2, 7, 8], 16, Sampling(), [9]))
        await until(lambda: bool(traj.calls))
        gave_up.cancel()  # its caller went away: the actor is told
        await asyncio.gather(gave_up, return_exceptions=True)
        lost = asyncio.ensure_future(turns.generate([1], 16, Sampling(), [9]))
        await until(lambda: bool(traj.calls))
        traj.lost("its node is gone")
        errors = []
        for call in (lost, turns.generate([1], 16, Sampling(), [9])):
            try:
                await call
            except EngineUnavailable as e:
                errors.append(str(e))
        turns.ended("the session ended")
        return sent, got, errors

    sent, got, errors = asyncio.run(go())
    assert got == out
    assert sent == [
        Generate("t", 1, [1, 2], 16, Sampling(), [9]), TurnDone("t", 2, 4, False),
        ToolBegan("t"), ToolDone("t", 0.5, 3, False),
        Generate("t", 2, [1, 2, 7, 8], 16, Sampling(), [9]), CancelCall("t", 2),
        Generate("t", 3, [1], 16, Sampling(), [9]), TurnsEnded("t", "the session ended")]
    # The turn in flight and the one after both fail as the engines' would.
    assert len(errors) == 2 and all("its node is gone" in e for e in errors), errors


def test_a_driven_trajectory_leaves_its_actors_count_at_its_last_event() -> None:
    # A replay or task leaves with its record (Finished); a driven one has none.
    async def go() -> list[tuple[list[str], int]]:
        rt = Runtime(FakeManualScheduler())
        channel = RunnerChannel("r", None, rt, call_gap_s=0.0, lost=lambda *_: None)
        for tid, driven in (("task", False), ("session", True)):
            channel.trajectories[tid] = RemoteTrajectory(
                channel.send, rt, tid, KVAcrossUpdates.RECOMPUTE, None, driven=driven)
        seen = []
        for m in (Done("task"), Done("session"), Finished("task", None, "cancelled")):
            channel._hear(m)
            seen.append((sorted(channel.trajectories), channel.ran))
        return seen

    assert asyncio.run(go()) == [(["session", "task"], 0), (["task"], 1), ([], 2)]

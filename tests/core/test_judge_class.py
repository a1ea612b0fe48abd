"""Judge calls are a scheduler class of their own: queued behind every rollout turn
on the same engine whatever their arrival, and ranked JUDGE_RANK above the policy's
priority (so a policy that preempts pauses them first)."""

from __future__ import annotations

from treadle.core.events import Admit, EngineAdded, TrajectoryArrived, TurnFinished
from treadle.core.scheduler import JUDGE_RANK, TrajectoryScheduler, TrajState


class OneSlot(TrajectoryScheduler):
    """FCFS (the default priority), everything on one engine, one turn at a time."""

    def route(self, t: TrajState, now: float) -> str | None:
        return next(iter(self.engines), None)

    def admission_cap(self, e: object) -> int:
        return 1


def admitted(s: TrajectoryScheduler, now: float) -> list[str]:
    return [d.traj_id for d in s.decide(now) if isinstance(d, Admit)]


def test_a_judge_turn_waits_behind_rollout_turns_that_came_after_it() -> None:
    s = OneSlot()
    s.on_event(EngineAdded("e0", tp=1, max_batch=8, kv_capacity_tokens=10**9), 0.0)
    s.on_event(TrajectoryArrived("r0", "g0", 10), 0.0)
    assert admitted(s, 0.0) == ["r0"]
    s.on_event(TrajectoryArrived("r0/judge/clarity/0", "g0", 10, judge=True), 1.0)
    s.on_event(TrajectoryArrived("r1", "g1", 10), 2.0)
    s.on_event(TrajectoryArrived("r2", "g2", 10), 3.0)
    assert admitted(s, 3.0) == []
    order = []
    for now in (4.0, 5.0, 6.0):
        running = next(iter(s.engines["e0"].running))
        s.on_event(TurnFinished(running, "e0", 5, 20, final=True), now)
        order += admitted(s, now)
    assert order == ["r1", "r2", "r0/judge/clarity/0"]
    judge = s.trajs["r0/judge/clarity/0"]
    assert judge.judge and judge.priority == JUDGE_RANK  # FCFS's 0.0, ranked as a judge

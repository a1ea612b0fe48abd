"""Judge calls are a scheduler class of their own: queued behind every rollout turn
on the same engine whatever their arrival, and ranked JUDGE_RANK above the policy's
priority (so a policy that preempts pauses them first). In the trajectory-aware
policies they have an estimator of their own, go to the least loaded engine without
a re-plan, and pause one another by predicted work as rollouts do."""

from __future__ import annotations

import pytest

from treadle.core.cost_model import CostModel
from treadle.core.events import (
    Admit,
    EngineAdded,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryArrived,
    TurnFinished,
)
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.predictor import Outcome, Predictor
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


# -- the trajectory-aware policies (`progressive`) ----------------------------------------

COST = CostModel.named("qwen3-14b", "h100")


def _treadle(lengths: dict[str, int], cap: int = 1, engines: int = 1) -> Treadle:
    """treadle told the true lengths, of rollouts and judge calls alike, on `engines`
    engines of `cap` sequences."""
    truth = {tid: Outcome(f"g-{tid}", 100, n, 1, 0.0) for tid, n in lengths.items()}
    p = Treadle(COST, TruthEstimator(truth), prior_lengths=[], typical_context=1000.0,
                judge_estimator=TruthEstimator(truth))
    for i in range(engines):
        p.on_event(EngineAdded(f"e{i}", 8, cap, 10**9), 0.0)
    return p


def _arrive(p: TrajectoryScheduler, tid: str, now: float, judge: bool = False) -> list[str]:
    p.on_event(TrajectoryArrived(tid, f"g-{tid}", 100, judge=judge), now)
    return admitted(p, now)


@pytest.mark.parametrize(("running", "queued", "paused"), [
    ("j-small", "j-big", True),  # within the class, more predicted work pauses less
    ("j-big", "j-small", False),  # ... and less never pauses more
    ("j-big", "rollout", True),  # a rollout turn pauses a judge call ...
    ("rollout", "j-big", False),  # ... and never the reverse
])
def test_a_queued_turn_pauses_a_running_one_by_class_then_by_work(
        running: str, queued: str, paused: bool) -> None:
    p = _treadle({"j-small": 10, "j-big": 1000, "rollout": 50})
    assert _arrive(p, running, 0.0, judge=running.startswith("j-")) == [running]
    after = _arrive(p, queued, 1.0, judge=queued.startswith("j-"))
    assert (after == [queued]) == paused
    assert p.engines["e0"].running == {queued if paused else running}
    assert p.preemptions == int(paused)


def test_a_judge_call_goes_to_the_least_loaded_engine_without_a_replan() -> None:
    p = _treadle({"r0": 5000, "r1": 5000, "r2": 5000, "j": 100}, cap=4, engines=2)
    for tid in ("r0", "r1", "r2"):
        p.on_event(TrajectoryArrived(tid, f"g-{tid}", 100), 0.0)
    p.decide(0.0)
    busiest = max(p.engines.values(), key=lambda e: len(e.running))
    replans = p.replans
    _arrive(p, "j", 1.0, judge=True)
    assert p.trajs["j"].engine_id != busiest.engine_id  # least loaded: the other one
    assert p.replans == replans  # no whole-batch re-plan for one judge call


def test_an_agentic_judges_next_turn_stays_where_its_kv_is() -> None:
    p = _treadle({"r0": 5000, "r1": 5000, "r2": 5000, "j": 100}, cap=4, engines=2)
    _arrive(p, "j", 0.0, judge=True)
    home = p.trajs["j"].engine_id
    assert home is not None
    p.on_event(TurnFinished("j", home, 50, 150, final=False), 1.0)
    p.on_event(ToolCallStarted("j"), 1.0)
    for tid in ("r0", "r1", "r2"):  # rollouts fill the judge's engine meanwhile
        p.on_event(TrajectoryArrived(tid, f"g-{tid}", 100), 1.0)
    p.decide(1.0)
    p.on_event(ToolCallFinished("j", 0.5, 20), 2.0)
    admitted(p, 2.0)
    # Its context is cached there: the least loaded engine would prefill it again.
    assert p.trajs["j"].engine_id == home


def test_judge_calls_do_not_teach_the_rollout_predictor() -> None:
    p = Treadle(COST, Predictor(), prior_lengths=[], typical_context=1000.0)
    p.on_event(EngineAdded("e0", 8, 8, 10**9), 0.0)
    _arrive(p, "r", 0.0)
    _arrive(p, "r/judge", 0.0, judge=True)
    p.on_event(TurnFinished("r/judge", "e0", 150, 250, final=True), 1.0)
    p.decide(1.0)
    assert isinstance(p.est, Predictor) and isinstance(p.judge_est, Predictor)
    assert (p.est.outcomes, p.judge_est.outcomes) == (0, 1)
    p.on_event(TurnFinished("r", "e0", 4000, 4100, final=True), 2.0)
    assert (p.est.outcomes, p.judge_est.outcomes) == (1, 1)

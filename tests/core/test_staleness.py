"""Staleness in the trajectory-aware policies (`progressive.Staleness`): across RL
steps an older trajectory runs first, and the gate puts off starting one that would
go stale before it could finish."""

from __future__ import annotations

import pytest

from treadle.core.cost_model import CostModel
from treadle.core.events import (
    Admit,
    Decision,
    EngineAdded,
    PolicyUpdated,
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryArrived,
    TurnFinished,
)
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.progressive import Staleness
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.predictor import Outcome

COST = CostModel.named("qwen3-14b", "h100")


def _policy(lengths: dict[str, int], staleness: Staleness | None, cap: int = 1) -> Treadle:
    """treadle told the true lengths (so the test knows its estimates), one engine
    of `cap` sequences."""
    truth = {tid: Outcome(f"g-{tid}", 100, n, 1, 0.0) for tid, n in lengths.items()}
    p = Treadle(COST, TruthEstimator(truth), prior_lengths=[], typical_context=1000.0,
                staleness=staleness)
    p.on_event(EngineAdded("e0", 8, cap, 10**9), 0.0)
    return p


def _admitted(decisions: list[Decision]) -> list[str]:
    return [d.traj_id for d in decisions if isinstance(d, Admit)]


def _finish(p: Treadle, tid: str, now: float) -> None:
    t = p.trajs[tid]
    p.on_event(TurnFinished(tid, "e0", 1, t.context_tokens + 1, True), now)


def _running_after_a_longer_one_arrives(staleness: Staleness | None) -> set[str]:
    """"old" starts at version 0 on the one slot; at version 1 "long", with far more
    work left, arrives: which one holds the slot?"""
    p = _policy({"old": 100, "long": 30000}, staleness)
    p.on_event(TrajectoryArrived("old", "g-old", 100), 0.0)
    assert _admitted(p.decide(0.0)) == ["old"]  # its oldest token: version 0
    p.on_event(PolicyUpdated(1), 1.0)
    p.on_event(TrajectoryArrived("long", "g-long", 100), 1.0)
    p.decide(1.0)
    p.decide(2.0)
    return set(p.engines["e0"].running)


def test_without_staleness_the_longest_remaining_work_runs_first() -> None:
    assert _running_after_a_longer_one_arrives(None) == {"long"}  # "old" was paused


def test_finish_first_runs_the_older_trajectory_first() -> None:
    assert _running_after_a_longer_one_arrives(Staleness(1, finish_first=True)) == {"old"}


@pytest.mark.parametrize("finish_first", [True, False])
def test_a_trajectory_back_from_its_tool_after_an_update_goes_first(finish_first: bool) -> None:
    """"b" sampled at version 0, then called a tool; at version 1 it is ready again
    beside "c", new and with more work left: with `finish_first` b runs first."""
    truth = {"a": Outcome("g-a", 100, 30000, 1, 0.0), "b": Outcome("g-b", 100, 200, 2, 1.0),
             "c": Outcome("g-c", 100, 5000, 1, 0.0)}
    p = Treadle(COST, TruthEstimator(truth), prior_lengths=[], typical_context=1000.0,
                staleness=Staleness(1, finish_first=finish_first))
    p.on_event(EngineAdded("e0", 8, 1, 10**9), 0.0)
    p.on_event(TrajectoryArrived("b", "g-b", 100), 0.0)
    assert _admitted(p.decide(0.0)) == ["b"]
    p.on_event(TurnFinished("b", "e0", 100, 200, False), 1.0)
    p.on_event(ToolCallStarted("b"), 1.0)
    p.on_event(TrajectoryArrived("a", "g-a", 100), 1.0)
    assert _admitted(p.decide(1.0)) == ["a"]
    p.on_event(PolicyUpdated(1), 2.0)
    p.on_event(TrajectoryArrived("c", "g-c", 100), 2.0)
    p.on_event(ToolCallFinished("b", 1.0, 10), 2.0)
    p.decide(2.0)
    _finish(p, "a", 3.0)
    assert _admitted(p.decide(3.0)) == (["b"] if finish_first else ["c"])


def _long_and_short_late_in_a_version(gate: bool) -> Treadle:
    """One update every 100 s; at 290 s, 10 s before the next, a trajectory of
    40,000 tokens and one of 10 arrive."""
    p = _policy({"long": 40000, "short": 10}, Staleness(1, finish_first=True, gate=gate),
                cap=8)
    p.on_event(PolicyUpdated(1), 100.0)
    p.on_event(PolicyUpdated(2), 200.0)
    p.on_event(TrajectoryArrived("long", "g-long", 100), 290.0)
    p.on_event(TrajectoryArrived("short", "g-short", 100), 290.0)
    return p


@pytest.mark.parametrize("gate", [True, False])
def test_the_gate_puts_off_what_cannot_finish_before_the_next_update(gate: bool) -> None:
    p = _long_and_short_late_in_a_version(gate)
    started = _admitted(p.decide(290.0))
    # 40,000 tokens take far longer than the 10 s left of the version; 10 do not.
    assert started == (["short"] if gate else ["long", "short"])
    assert p.held == (1 if gate else 0)
    p.on_event(PolicyUpdated(3), 300.0)  # a fresh window: now is as early as it gets
    assert _admitted(p.decide(300.0)) == (["long"] if gate else [])


def test_a_trajectory_with_a_looser_bound_of_its_own_is_not_gated() -> None:
    """The same long trajectory that the policy's bound (1 version) puts off starts
    at once when its job allows 3: its window is its own."""
    p = _policy({"long": 40000, "loose": 40000}, Staleness(1, finish_first=True, gate=True),
                cap=8)
    p.on_event(PolicyUpdated(1), 100.0)
    p.on_event(PolicyUpdated(2), 200.0)  # one update every 100 s
    p.on_event(TrajectoryArrived("long", "g-long", 100), 290.0)
    p.on_event(TrajectoryArrived("loose", "g-loose", 100, max_staleness=3), 290.0)
    # 40,000 tokens take some 100-odd seconds: over the 10 s left of one version,
    # within the 210 s left of three.
    assert _admitted(p.decide(290.0)) == ["loose"] and p.held == 1


def test_a_tighter_bound_of_its_own_ranks_a_trajectory_as_older() -> None:
    """Two trajectories of the same age: the one whose job allows no staleness runs
    before the one with more work left and the policy's bound of 2."""
    p = _policy({"strict": 100, "long": 30000}, Staleness(2, finish_first=True))
    p.on_event(TrajectoryArrived("long", "g-long", 100), 0.0)
    p.on_event(TrajectoryArrived("strict", "g-strict", 100, max_staleness=0), 0.0)
    assert _admitted(p.decide(0.0)) == ["strict"]
    q = _policy({"strict": 100, "long": 30000}, Staleness(2, finish_first=True))
    q.on_event(TrajectoryArrived("long", "g-long", 100), 0.0)
    q.on_event(TrajectoryArrived("strict", "g-strict", 100), 0.0)  # the policy's bound
    assert _admitted(q.decide(0.0)) == ["long"]  # same age: more work left first



def test_what_the_gate_holds_starts_once_nothing_else_is_in_flight() -> None:
    """Every trajectory left too long for its window: none else runs, so no batch
    completes and no update comes. The gate must not hold them for ever."""
    p = _long_and_short_late_in_a_version(gate=True)
    assert _admitted(p.decide(290.0)) == ["short"] and p.held == 1
    _finish(p, "short", 291.0)
    # Only the held one is left: no engine runs or queues anything, no tool call is out.
    assert _admitted(p.decide(291.0 + p.replan_s)) == ["long"]

"""treadle's placement trust across RL steps (`Treadle.placement_fit`): it places
by predicted length while its predictions at arrival have ranked the outcomes, and
by count once they have not."""

from __future__ import annotations

from collections import Counter

import pytest

from treadle.core.cost_model import CostModel
from treadle.core.events import (
    EngineAdded,
    PolicyUpdated,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnFinished,
)
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.progressive import Staleness
from treadle.core.policies.treadle_policy import FIT_SAMPLES, Treadle
from treadle.core.predictor import Outcome

COST = CostModel.named("qwen3-14b", "h100")
PREDICTED = [100 + 37 * i for i in range(FIT_SAMPLES)]  # what the estimator says at arrival
STALENESS = Staleness(1)
HEAD = {"head": 5000, "dropped": 5000}
PROBE = {"long": 100_000, **{f"short{i}": 10 for i in range(6)}}


def _policy(staleness: Staleness | None = STALENESS) -> Treadle:
    lengths = {f"t{i}": n for i, n in enumerate(PREDICTED)} | PROBE | HEAD
    truth = {tid: Outcome(f"g-{tid}", 100, n, 1, 0.0) for tid, n in lengths.items()}
    p = Treadle(COST, TruthEstimator(truth), prior_lengths=[], typical_context=1000.0,
                staleness=staleness)
    for eid in ("e0", "e1"):
        p.on_event(EngineAdded(eid, 8, 1024, 10**9), 0.0)
    p.on_event(PolicyUpdated(1), 1.0)
    return p


def _trained(outcomes: list[int], staleness: Staleness | None = STALENESS,
             p: Treadle | None = None) -> Treadle:
    """treadle on two engines after FIT_SAMPLES trajectories, predicted `PREDICTED`
    at arrival (a test double that knows them), finished with `outcomes` tokens."""
    p = _policy(staleness) if p is None else p
    for i, actual in enumerate(outcomes):
        tid = f"t{i}"
        p.on_event(TrajectoryArrived(tid, f"g-{tid}", 100), 2.0)
        p.decide(2.0)
        t = p.trajs[tid]
        assert t.engine_id is not None
        p.on_event(TurnFinished(tid, t.engine_id, actual, 100 + actual, True), 3.0)
    return p


def _probe_counts(p: Treadle) -> list[int]:
    """Trajectories per engine when one predicted far longer than six others is placed."""
    for tid in PROBE:
        p.on_event(TrajectoryArrived(tid, f"g-{tid}", 100), 4.0)
    live = [p.trajs[tid] for tid in PROBE]
    plan = p.plan(live, p.live_engines())
    return sorted(Counter(plan.values()).values())


def test_informative_predictions_place_by_length() -> None:
    p = _trained(PREDICTED)
    fit = p.placement_fit()
    assert fit is not None and fit > 0.99
    assert _probe_counts(p) == [1, 6]  # the long one alone: LPT
    assert p.count_balanced == 0


@pytest.mark.parametrize("outcomes", [PREDICTED[::-1], [500] * (FIT_SAMPLES - 1) + [501]])
def test_predictions_that_do_not_rank_outcomes_place_by_count(outcomes: list[int]) -> None:
    p = _trained(outcomes)
    fit = p.placement_fit()
    assert fit is not None and fit < 0.3
    assert _probe_counts(p) == [3, 4]
    assert p.count_balanced >= 1


def test_without_a_staleness_policy_nothing_is_measured() -> None:
    """One rollout step (no `Staleness`): the placement always trusts its predictions."""
    p = _trained(PREDICTED[::-1], staleness=None)
    assert p.placement_fit() is None
    assert _probe_counts(p) == [1, 6]


def test_the_window_takes_outcomes_in_arrival_order() -> None:
    """A trajectory still running holds back those that arrived after it (a window
    by finish time would hold only the short ones of a step); one that ended without
    finishing is dropped and holds nothing back."""
    p = _policy()
    for tid in HEAD:
        p.on_event(TrajectoryArrived(tid, f"g-{tid}", 100), 1.5)
    p.decide(1.5)
    p.on_event(TrajectoryEnded("dropped", "restarted"), 1.6)
    _trained(PREDICTED, p=p)
    assert p.placement_fit() is None  # "head" arrived first and still runs
    head = p.trajs["head"]
    assert head.engine_id is not None
    p.on_event(TurnFinished("head", head.engine_id, 5000, 5100, True), 5.0)
    fit = p.placement_fit()
    assert fit is not None and fit > 0.9
    assert len(p._fit) == FIT_SAMPLES + 1 and not p._outcome and not p._awaited

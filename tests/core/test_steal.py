"""Work stealing (`Progressive._steal`): an engine with a free slot and no queue takes
the head of the longest queue, and only such an engine steals (the pass ends at once
when there is none)."""

from __future__ import annotations

from treadle.core.cost_model import CostModel
from treadle.core.events import (
    Admit,
    EngineAdded,
    EngineRemoved,
    TrajectoryArrived,
    TrajectoryEnded,
)
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.predictor import Outcome
from treadle.core.scheduler import EngineState, Phase, TrajState

COST = CostModel.named("qwen3-14b", "h100")


def test_only_an_idle_engine_steals_and_it_takes_the_longest_queues_head() -> None:
    lengths = {"a": 9000, "b": 8000, "c": 700, "d": 600, "e": 500}
    truth = {tid: Outcome("g", 100, n, 1, 0.0) for tid, n in lengths.items()}
    p = Treadle(COST, TruthEstimator(truth), prior_lengths=[], typical_context=1000.0)
    for eid in ("e0", "e1"):
        p.on_event(EngineAdded(eid, 8, 1, 10**9), 0.0)  # one sequence at a time
    for tid in lengths:
        p.on_event(TrajectoryArrived(tid, "g", 100), 0.0)
    p.decide(0.0)
    queues = {eid: e.queued for eid, e in p.engines.items()}
    assert sorted(queues.values()) == [0, 3] and p.steals == 0  # both engines full
    short, long_ = sorted(p.engines, key=lambda eid: queues[eid])
    # The engine with no queue runs out of work: its running turn ends.
    for tid, t in list(p.trajs.items()):
        if t.engine_id == short:
            p.on_event(TrajectoryEnded(tid, "cancelled"), 1.0)
    head = p.engines[long_].queue.peek()
    assert head is not None
    out = p.decide(1.0)
    assert p.steals == 1
    assert Admit(head[2], short, head[0]) in out
    assert p.trajs[head[2]].phase is Phase.RUNNING and p.engines[long_].queued == 2
    p.decide(1.0)
    assert p.steals == 1  # the thief is full again


class _Pinned(Treadle):
    """A test double: treadle with its placement given (`pins`), not computed."""

    def __init__(self, pins: dict[str, str], truth: dict[str, Outcome]) -> None:
        super().__init__(COST, TruthEstimator(truth), prior_lengths=[],
                         typical_context=1000.0, reconfigure=False)
        self.pins = pins

    def plan(self, live: list[TrajState], engines: list[EngineState]) -> dict[str, str]:
        return {t.traj_id: self.pins[t.traj_id] for t in live}


def _blocked() -> _Pinned:
    """Two engines, each running its longest trajectory with the next waiting for KV:
    b with s, or c with d, would pass the budget, and e0 cannot take d while s waits
    there. (Prompt tokens: what a turn needs of the KV budget; output tokens: the
    rank.)"""
    shapes = {"b": ("e0", 8000, 2000), "s": ("e0", 2000, 1000),
              "c": ("e1", 9000, 3000), "d": ("e1", 1000, 1500), "e": ("e1", 1000, 1200)}
    truth = {tid: Outcome("g", prompt, out, 20, 0.0) for tid, (_, prompt, out) in shapes.items()}
    p = _Pinned({tid: eid for tid, (eid, _, _) in shapes.items()}, truth)
    for eid in ("e0", "e1"):  # a KV budget of 10,000 tokens (0.8 of the cache)
        p.on_event(EngineAdded(eid, 8, 4, 12_500), 0.0)
    for tid, (_, prompt, _) in shapes.items():
        p.on_event(TrajectoryArrived(tid, "g", prompt), 0.0)
    p.decide(0.0)
    assert {eid: sorted(e.running) for eid, e in p.engines.items()} == {"e0": ["b"],
                                                                       "e1": ["c"]}
    assert p.engines["e0"].queued == 1 and p.engines["e1"].queued == 2 and p.steals == 0
    return p


def test_an_engine_whose_queue_a_cancel_empties_steals() -> None:
    p = _blocked()
    p.on_event(TrajectoryEnded("s", "cancelled"), 1.0)  # e0's queue is empty now
    out = p.decide(1.0)
    assert p.steals == 1 and any(isinstance(d, Admit) and d.traj_id == "d"
                                 and d.engine_id == "e0" for d in out)


def test_an_engine_removed_with_turns_queued_gives_none_away() -> None:
    p = _blocked()
    p.on_event(EngineRemoved("e1"), 1.0)  # with d and e queued (no drain before)
    p.on_event(TrajectoryEnded("s", "cancelled"), 1.0)
    p.decide(1.0)
    assert p.steals == 0

"""Work stealing (`Progressive._steal`): an engine with a free slot and no queue takes
the head of the longest queue, and only such an engine steals (the pass ends at once
when there is none)."""

from __future__ import annotations

from treadle.core.cost_model import CostModel
from treadle.core.events import Admit, EngineAdded, TrajectoryArrived, TrajectoryEnded
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.predictor import Outcome
from treadle.core.scheduler import Phase

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

"""treadle's list placement (`core.policies.list_placement`): its heap loop, written
out over columns for speed, places exactly as `_Load`'s own methods do; and a
re-plan's read of every estimate (`Progressive.remaining_of`) is `remaining`'s."""

from __future__ import annotations

import heapq
import random

from treadle.core.cost_model import CostModel
from treadle.core.events import TrajectoryArrived
from treadle.core.policies import list_placement as lp
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.predictor import Estimate, Outcome
from treadle.core.scheduler import EngineState, TrajState

COST = CostModel.named("qwen3-14b", "h100")


def _by_the_methods(batch: lp.Batch, engines: list[EngineState]) -> list[int]:
    """The reference: the same placement with `_Load.add` and `_Load.finish_with`."""
    order = lp._longest_first(batch)
    loads = [lp._Load(e.tp) for e in engines]
    engine_of = [0] * len(order)
    n_tail = min(len(order), lp.TAIL_PER_ENGINE * len(engines),
                 max(lp.TAIL_MAX, len(engines)))
    tail = order[:n_tail]
    picks = lp._place_tail([(batch.remaining[j], batch.context[j]) for j in tail], loads, COST)
    for j, i in zip(tail, picks, strict=True):
        engine_of[j] = i
    rest = order[n_tail:]
    if rest:
        typ_rem = batch.remaining[rest[len(rest) // 2]]
        typ_ctx = sum(batch.context[j] for j in rest) / len(rest)
        heap = [(ld.finish_with(COST, typ_rem, typ_ctx), i) for i, ld in enumerate(loads)]
        heapq.heapify(heap)
        for j in rest:
            _, i = heapq.heappop(heap)
            loads[i].add(batch.remaining[j], batch.context[j])
            engine_of[j] = i
            heapq.heappush(heap, (loads[i].finish_with(COST, typ_rem, typ_ctx), i))
    return engine_of


def test_the_heap_loop_places_as_the_loads_own_methods_do() -> None:
    rng = random.Random(11)
    for _ in range(300):
        # Equal lengths (siblings) and lengths below one token on purpose; few
        # engines, so most of the batch goes by the heap, many to an engine.
        n = rng.randint(1, 400)
        scale = rng.choice([1.0, 1.0, 1.0, 0.001])  # every length under one token
        remaining = [scale * rng.choice([0.25, 0.5, 1.0, 40.0, 300.0, 2500.0, 9000.0])
                     * rng.choice([1.0, 1.0, rng.uniform(1.0, 3.0)]) for _ in range(n)]
        batch = lp.Batch([f"t{k:04d}" for k in range(n)][::-1], remaining,
                         [rng.choice([100.0, 4000.0, 30000.0]) for _ in range(n)])
        # A TP-8 engine beside TP-1s may take several of the longest and leave a TP-1
        # engine none: its first from the heap sets its head.
        engines = [EngineState(f"e{i}", tp, 256, COST.kv_capacity_tokens(tp)) for i, tp in
                   enumerate(rng.choice([1, 2, 4, 8, 8]) for _ in range(rng.randint(1, 6)))]
        assert lp.lpt_placement(batch, engines, COST) == _by_the_methods(batch, engines)


def test_a_replan_reads_each_estimate_as_remaining_does() -> None:
    """`Progressive.remaining_of` checks a memo's freshness inline: it must agree with
    `remaining` (through `estimate`) for fresh memos, memos a turn or a generation
    old, none, and estimates under one token."""
    truth = {f"t{k}": Outcome("g", 100, 500 * (k + 1), 4, 1.0) for k in range(5)}
    policy = Treadle(COST, TruthEstimator(truth), prior_lengths=[], typical_context=1000.0)
    for tid in truth:
        policy.on_event(TrajectoryArrived(tid, "g", 100), 0.0)
    policy._generation = 2

    def staged() -> list[TrajState]:
        live = [policy.trajs[f"t{k}"] for k in range(5)]
        stale = Estimate(9e9, 9e9, 1.0, 0.0)  # wrong on purpose: used only if fresh
        for t, (memo, turns, generation) in zip(live, [
                (Estimate(10.0, 0.25, 1.0, 0.0), 0, 2),  # fresh, under one token
                (Estimate(10.0, 7.0, 1.0, 0.0), 0, 2),  # fresh
                (stale, -1, 2),  # a turn old
                (stale, 0, 1),  # a generation old
                (None, -1, -1)], strict=True):
            t.memo, t.memo_turns, t.memo_generation = memo, turns, generation
        return live

    read = policy.remaining_of(staged())
    assert read == [max(1.0, policy.remaining(t)) for t in staged()]
    assert read[:2] == [1.0, 7.0] and 9e9 not in read

"""Layout planning (heddle's annealing, treadle's model-scored candidates),
treadle's interference-aware list placement and its migration price."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from treadle.core.cost_model import CostModel
from treadle.core.events import EngineAdded
from treadle.core.policies.layout import (
    anneal_layout,
    group_caps,
    homogeneous_pool,
    layout_makespan,
    reduce_lengths,
)
from treadle.core.policies.list_placement import (
    Batch,
    candidate_layouts,
    lpt_layout,
    lpt_makespan,
    lpt_placement,
)
from treadle.core.policies.treadle_policy import MIXED_MARGIN, Treadle
from treadle.core.predictor import Estimate
from treadle.core.scheduler import EngineState, Phase, TrajState

COST = CostModel.named("qwen3-14b", "h100")


def _lengths(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return sorted((rng.lognormvariate(8.5, 1.0) for _ in range(n)), reverse=True)


def _engines(layout: tuple[int, ...]) -> list[EngineState]:
    return [EngineState(f"e{i:03d}", tp, 1024, COST.kv_capacity_tokens(tp))
            for i, tp in enumerate(layout)]


def test_homogeneous_pool_fills_the_budget_or_says_why() -> None:
    assert homogeneous_pool(64, 8, "p") == [8] * 8
    assert homogeneous_pool(10, 4, "p") == [4, 4]
    with pytest.raises(ValueError, match="cannot hold one TP-8"):
        homogeneous_pool(4, 8, "p")


def test_reduce_lengths_keeps_the_distribution_and_the_weight() -> None:
    lengths = _lengths(1000, 1)
    reduced, weight = reduce_lengths(lengths, items=100)
    assert weight == 10 and len(reduced) == 100
    assert reduced == sorted(reduced, reverse=True)
    assert reduced[0] == max(lengths)
    small, w = reduce_lengths(lengths[:50], items=100)
    assert w == 1 and len(small) == 50


def test_group_caps_cover_the_batch_in_proportion_to_kv() -> None:
    caps = group_caps([100_000, 200_000], context=1000, trajectories=10_000, max_batch=100_000)
    assert sum(caps) >= 10_000
    assert caps[1] == pytest.approx(2 * caps[0], rel=0.02)
    roomy = group_caps([100_000], context=1000, trajectories=5, max_batch=1024)
    assert roomy == [80]  # what 80% of the cache holds: nothing to scale up
    assert group_caps([10**9], context=1, trajectories=5, max_batch=64) == [64]


def test_annealing_is_deterministic_and_uses_every_gpu() -> None:
    lengths = _lengths(256, 2)
    a = anneal_layout(64, lengths, COST, 4000.0, 1024, start_tp=1, seed=3, iterations=150)
    b = anneal_layout(64, lengths, COST, 4000.0, 1024, start_tp=1, seed=3, iterations=150)
    assert a == b
    assert sum(a) == 64 and all(tp in (1, 2, 4, 8) for tp in a)
    start = layout_makespan((1,) * 64, reduce_lengths(lengths)[0], COST, 4000.0, 1024,
                            reduce_lengths(lengths)[1])
    found = layout_makespan(a, reduce_lengths(lengths)[0], COST, 4000.0, 1024,
                            reduce_lengths(lengths)[1])
    assert found <= start  # annealing keeps the best layout it saw


def test_candidate_layouts_use_the_whole_budget_at_or_above_min_tp() -> None:
    layouts = candidate_layouts(64, 2)
    assert (8,) * 8 in layouts and (2,) * 32 in layouts
    assert all(sum(layout) <= 64 and min(layout) >= 2 for layout in layouts)
    assert len(set(layouts)) == len(layouts)


def test_lpt_layout_returns_a_candidate() -> None:
    layout = lpt_layout(64, _lengths(512, 4), COST, 4000.0, 1024)
    assert layout in candidate_layouts(64, COST.min_tp())


def _pool_scores(lengths: list[float], context: float) -> dict[int, float]:
    batch = Batch.expected(lengths, context)
    return {tp: lpt_makespan(batch, _engines((tp,) * (64 // tp)), COST) for tp in (1, 2, 4, 8)}


def test_lpt_layout_never_picks_a_pool_the_model_scores_below_another_pool() -> None:
    """A flat batch of 1,024 (7,000 tokens each): the model scores TP-4 ahead of TP-8
    by about 3%, within the mixed-layout tolerance; the search must still return the
    better pool (it used to return TP-8, the fewest engines within the tolerance)."""
    flat = [7000.0] * 1024
    scores = _pool_scores(flat, 3500.0)
    assert scores[4] < scores[8]
    assert lpt_layout(64, flat, COST, 3500.0, 1024) == (4,) * 16
    # Few long trajectories per engine: TP-8 scores best and is kept.
    few = [20_000.0] * 64
    scores = _pool_scores(few, 10_000.0)
    assert scores[8] == min(scores.values())
    assert lpt_layout(64, few, COST, 10_000.0, 1024) == (8,) * 8


def _batch(items: list[tuple[str, float, float]]) -> Batch:
    """A batch of (id, remaining tokens, context tokens) rows."""
    return Batch([i for i, _, _ in items], [r for _, r, _ in items], [c for _, _, c in items])


def _plan(items: list[tuple[str, float, float]], engines: list[EngineState]) -> dict[str, str]:
    """`lpt_placement` of (id, remaining, context) rows, as id -> engine id."""
    picks = lpt_placement(_batch(items), engines, COST)
    return {tid: engines[i].engine_id for (tid, _, _), i in zip(items, picks, strict=True)}


def test_lpt_placement_spreads_the_longest_one_per_engine() -> None:
    engines = _engines((8,) * 6)
    items = [(f"t{i:03d}", float(10_000 - i), 2000.0) for i in range(60)]
    plan = _plan(items, engines)
    assert set(plan) == {tid for tid, _, _ in items}
    longest_six = [plan[f"t{i:03d}"] for i in range(6)]
    assert len(set(longest_six)) == 6  # one per engine before any engine gets two
    counts = [list(plan.values()).count(e.engine_id) for e in engines]
    assert max(counts) - min(counts) <= 1  # equal lengths: an even spread
    assert _plan(items, engines) == plan  # deterministic


def test_lpt_placement_prefers_fast_engines_for_the_tail() -> None:
    engines = _engines((2, 2, 4, 4, 8, 8))
    items = [(f"t{i:03d}", float(10_000 - i), 2000.0) for i in range(60)]
    plan = _plan(items, engines)
    # A second long trajectory on a TP-8 engine is still faster than a TP-2 alone.
    assert {plan[f"t{i:03d}"] for i in range(4)} <= {"e004", "e005"}


def _every_engine_tail(items: list[tuple[str, float, float]], engines: list[EngineState],
                       ) -> dict[str, str]:
    """The tail's placement by evaluating every engine for every item: the reference
    `lpt_placement`'s pruned search must agree with, pick for pick."""
    from treadle.core.policies.list_placement import _Load

    loads = [_Load(e.tp) for e in engines]
    out = {}
    for tid, rem, ctx in sorted(items, key=lambda it: (-it[1], it[0])):
        best = min(range(len(loads)), key=lambda i: (loads[i].finish_with(COST, rem, ctx), i))
        loads[best].add(rem, ctx)
        out[tid] = engines[best].engine_id
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_pruned_tail_search_places_as_evaluating_every_engine_would(seed: int) -> None:
    rng = random.Random(seed)
    layout = tuple(rng.choice((1, 2, 4, 8)) for _ in range(rng.randint(1, 24)))
    n = rng.randint(1, 4 * len(layout))  # all of them in the tail
    # Repeated lengths (ties break by engine index alike), and some under one token
    # (no bound for the engines holding those).
    lengths = [float(rng.choice((0.4, 50, 400, 3000))) if rng.random() < 0.3
               else rng.lognormvariate(7.5, 1.2) for _ in range(n)]
    items = [(f"t{i:03d}", length, float(rng.choice((0, 500, 8000))))
             for i, length in enumerate(lengths)]
    engines = _engines(layout)
    assert _plan(items, engines) == _every_engine_tail(items, engines)


def _heap_rest(items: list[tuple[str, float, float]], engines: list[EngineState],
               ) -> dict[str, str]:
    """The whole list placement written plainly: the tail as `_every_engine_tail`
    places it, the rest each popped off a heap keyed on `_Load.finish_with` of a
    typical short trajectory, added, and pushed back with its new key: the reference
    `lpt_placement`'s inlined loop must agree with, pick for pick."""
    import heapq

    from treadle.core.policies.list_placement import TAIL_MAX, TAIL_PER_ENGINE, _Load

    order = sorted(items, key=lambda it: (-it[1], it[0]))
    n_tail = min(len(order), TAIL_PER_ENGINE * len(engines), max(TAIL_MAX, len(engines)))
    out = _every_engine_tail(order[:n_tail], engines)
    loads = [_Load(e.tp) for e in engines]
    index = {e.engine_id: i for i, e in enumerate(engines)}
    for tid, rem, ctx in order[:n_tail]:
        loads[index[out[tid]]].add(rem, ctx)
    rest = order[n_tail:]
    typ_rem = rest[len(rest) // 2][1]
    typ_ctx = sum(it[2] for it in rest) / len(rest)
    heap = [(ld.finish_with(COST, typ_rem, typ_ctx), i) for i, ld in enumerate(loads)]
    heapq.heapify(heap)
    for tid, rem, ctx in rest:
        _, i = heapq.heappop(heap)
        loads[i].add(rem, ctx)
        out[tid] = engines[i].engine_id
        heapq.heappush(heap, (loads[i].finish_with(COST, typ_rem, typ_ctx), i))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_placement_past_the_tail_is_the_plain_heap_placement(seed: int) -> None:
    rng = random.Random(seed)
    layout = tuple(rng.choice((1, 2, 4, 8)) for _ in range(rng.randint(2, 12)))
    n = rng.randint(5, 30) * len(layout)  # past the tail's 4 an engine
    lengths = [float(rng.choice((0.4, 50, 400))) if rng.random() < 0.3
               else rng.lognormvariate(7.5, 1.2) for _ in range(n)]
    items = [(f"t{i:03d}", length, float(rng.choice((0, 500, 8000))))
             for i, length in enumerate(lengths)]
    engines = _engines(layout)
    assert _plan(items, engines) == _heap_rest(items, engines)
    # Ties between equal lengths go by id, whatever the batch's order.
    rng.shuffle(items)
    assert _plan(items, engines) == _heap_rest(items, engines)


def test_a_batch_refuses_columns_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 ids, 1 remaining, 2 contexts"):
        Batch(["a", "b"], [1.0], [0.0, 0.0])


def test_the_expected_batch_stands_each_representative_for_its_weight() -> None:
    lengths = _lengths(1000, 2)
    reduced, weight = reduce_lengths(lengths)
    assert weight > 1
    batch = Batch.expected(lengths, 3000.0)
    assert len(batch.ids) == len(reduced) * weight == len(set(batch.ids))
    assert Counter(batch.remaining) == {r: weight * n for r, n in Counter(reduced).items()}
    assert set(batch.context) == {3000.0}


def test_a_placement_without_engines_says_so() -> None:
    assert lpt_placement(Batch([], [], []), [], COST) == []
    with pytest.raises(ValueError, match="no engines to place 1 trajectories"):
        lpt_placement(Batch(["t"], [10.0], [0.0]), [], COST)


def test_lpt_makespan_falls_with_more_engines_but_not_below_the_longest() -> None:
    items = [(f"t{i}", length, 3000.0) for i, length in enumerate(_lengths(200, 5))]
    one = lpt_makespan(_batch(items), _engines((8,)), COST)
    eight = lpt_makespan(_batch(items), _engines((8,) * 8), COST)
    longest = max(length for _, length, _ in items)
    assert longest * COST.step_time(8, 1, 3000.0) <= eight < one


# -- migration price ---------------------------------------------------------------------


class FakeEstimator:
    """Test double: every trajectory has the same fixed estimate."""

    def __init__(self, estimate: Estimate) -> None:
        self.fixed = estimate

    def arrived(self, traj_id: str, group_id: str, prompt_tokens: int) -> None: ...
    def turn_finished(self, traj_id: str, output_tokens: int) -> None: ...
    def tool_finished(self, traj_id: str, latency_s: float) -> None: ...
    def finished(self, traj_id: str) -> None: ...
    def forget(self, traj_id: str) -> None: ...

    def estimate(self, traj_id: str) -> Estimate:
        return self.fixed


def _treadle_with_a_move(remaining: float, tool_s: float, turns: float,
                         busy: int) -> tuple[Treadle, TrajState]:
    """Two TP-8 engines, the source running `busy` sequences of 20K context and the
    destination idle, and one trajectory of 30K context in a tool call on the source."""
    sched = Treadle(COST, FakeEstimator(Estimate(remaining + 5000, remaining, turns, tool_s)),
                    prior_lengths=[], typical_context=4096.0)
    for eid in ("e0", "e1"):
        sched.on_event(EngineAdded(eid, 8, 1024, COST.kv_capacity_tokens(8)), 0.0)
    src = sched.engines["e0"]
    src.running = {f"r{i}" for i in range(busy)}
    src.kv_reserved = 20_000 * busy
    t = TrajState("a", "g", 500, 0.0, context_tokens=30_000, turns_done=3, phase=Phase.TOOL,
                  engine_id="e0")
    sched.trajs["a"] = t
    return sched, t


def _saved_per_token(busy: int) -> float:
    return COST.step_time(8, busy + 1, 20_000 * busy + 30_000) - COST.step_time(8, 1, 30_000)


def test_a_move_hidden_by_a_long_tool_call_is_priced_by_what_shows() -> None:
    move, busy = COST.migration_time(30_000), 50
    # Remaining tokens chosen so that the move saves 1.5x the whole transfer: below
    # the margin of 2 if all of the transfer were delay, far above it once a 20 s
    # mean tool call hides most of it.
    remaining = 1.5 * move / _saved_per_token(busy)
    slow_tool, t = _treadle_with_a_move(remaining, tool_s=2 * 20.0, turns=2.0, busy=busy)
    assert slow_tool.migration_margin == 2.0
    assert slow_tool.should_migrate(t, "e0", "e1", 0.0)
    no_tool, t = _treadle_with_a_move(remaining, tool_s=0.0, turns=2.0, busy=busy)
    assert not no_tool.should_migrate(t, "e0", "e1", 0.0)
    # What shows of it: E[max(0, m - L)] for an exponential L of mean 20 s.
    exposed = move - 20.0 * (1 - math.exp(-move / 20.0))
    assert 0 < exposed < 0.01 * move
    tight, t = _treadle_with_a_move(2.0 * exposed / _saved_per_token(busy) * 1.01,
                                    tool_s=2 * 20.0, turns=2.0, busy=busy)
    assert tight.should_migrate(t, "e0", "e1", 0.0)
    tight, t = _treadle_with_a_move(2.0 * exposed / _saved_per_token(busy) * 0.99,
                                    tool_s=2 * 20.0, turns=2.0, busy=busy)
    assert not tight.should_migrate(t, "e0", "e1", 0.0)


def test_a_move_that_saves_nothing_is_never_made() -> None:
    sched, t = _treadle_with_a_move(50_000.0, tool_s=1e4, turns=2.0, busy=0)
    assert not sched.should_migrate(t, "e0", "e1", 0.0)  # both engines idle: no saving


# -- a scored layout choice ----------------------------------------------------------------


class FakeScorer:
    """Test double for a `LayoutScorer`: a fixed score per pool (a default for the
    rest), and the pools it was asked about."""

    def __init__(self, scores: dict[tuple[int, ...], float], default: float = 100.0) -> None:
        self.scores, self.default = scores, default
        self.asked: list[tuple[int, ...]] = []

    def __call__(self, layout: tuple[int, ...]) -> float:
        self.asked.append(layout)
        return self.scores.get(layout, self.default)


def _treadle(scorer: FakeScorer | None, lengths: list[float]) -> Treadle:
    from treadle.core.predictor import Predictor

    return Treadle(COST, Predictor(), prior_lengths=lengths, typical_context=4096.0,
                   layout_scorer=scorer)


HOMOGENEOUS_64 = [(1,) * 64, (2,) * 32, (4,) * 16, (8,) * 8]


def test_the_scorer_is_asked_about_every_homogeneous_pool_and_two_mixed_ones() -> None:
    scorer = FakeScorer({})
    _treadle(scorer, _lengths(1024, 0)).initial_pool(64)
    assert scorer.asked[:4] == HOMOGENEOUS_64
    mixed = scorer.asked[4:]
    assert len(mixed) == 2 and all(len(set(m)) > 1 and sum(m) <= 64 for m in mixed)


@pytest.mark.parametrize("best", HOMOGENEOUS_64)
def test_the_pool_the_scorer_rates_best_is_taken(best: tuple[int, ...]) -> None:
    """By construction treadle's pool is never one its scorer rates below a
    homogeneous pool: whichever pool scores lowest is the one it starts."""
    scorer = FakeScorer({(8,) * 8: 60.0, (4,) * 16: 60.0, best: 50.0})
    policy = _treadle(scorer, _lengths(1024, 1))
    chosen = tuple(policy.initial_pool(64))
    assert chosen == best
    assert policy.layout_scores[chosen] == min(policy.layout_scores.values())


def test_a_mixed_pool_wins_only_by_its_score_and_ties_go_to_fewer_engines() -> None:
    lengths = _lengths(1024, 2)
    mixed = FakeScorer({})
    _treadle(mixed, lengths).initial_pool(64)
    candidate = mixed.asked[4]
    assert tuple(_treadle(FakeScorer({candidate: 10.0}), lengths).initial_pool(64)) == candidate
    # 3% ahead, less than the margin: the best homogeneous pool.
    assert MIXED_MARGIN > 0.03
    near = FakeScorer({candidate: 97.0})
    assert tuple(_treadle(near, lengths).initial_pool(64)) == (8,) * 8
    # A tie between pools: the one with fewer engines.
    assert tuple(_treadle(FakeScorer({}, default=7.0), lengths).initial_pool(64)) == (8,) * 8


def test_without_a_scorer_the_list_placement_model_decides() -> None:
    lengths = _lengths(1024, 3)
    assert tuple(_treadle(None, lengths).initial_pool(64)) == lpt_layout(
        64, lengths, COST, 4096.0, 1024)

"""treadle's kept placement (`core.policies.kept_placement`): a re-plan places only the
trajectories changed since the last one; the loads it keeps are those of the
placement it holds, the others keep their engine, and the policy falls back to a
full placement when the engines or the estimates' generation change."""

from __future__ import annotations

import math
import random

import pytest

from treadle.core.cost_model import CostModel
from treadle.core.events import EngineAdded, TrajectoryArrived
from treadle.core.policies.kept_placement import Item, KeptPlacement
from treadle.core.policies.list_placement import Load, lpt_placement
from treadle.core.policies.oracle import TruthEstimator
from treadle.core.policies.treadle_policy import Treadle
from treadle.core.predictor import Outcome
from treadle.core.scheduler import EngineState

COST = CostModel.named("qwen3-14b", "h100")


def _engines(layout: tuple[int, ...]) -> list[EngineState]:
    return [EngineState(f"e{i:03d}", tp, 1024, COST.kv_capacity_tokens(tp))
            for i, tp in enumerate(layout)]


def _items(rng: random.Random, ids: list[str]) -> list[Item]:
    return [(tid, max(1.0, round(rng.lognormvariate(7.0, 1.2))), float(rng.choice((0, 2000))))
            for tid in ids]


def _loads_from_scratch(kept: KeptPlacement) -> list[Load]:
    loads = [Load(ld.tp) for ld in kept.loads]
    for rem, ctx, i in kept.placed.values():
        loads[i].add(rem, ctx)
    return loads


@pytest.mark.parametrize("seed", range(4))
def test_an_update_keeps_the_others_and_the_loads_of_what_it_holds(seed: int) -> None:
    rng = random.Random(seed)
    engines = _engines(tuple(rng.choice((1, 2, 8)) for _ in range(rng.randint(2, 10))))
    ids = [f"t{i:04d}" for i in range(rng.randint(40, 200))]
    items = _items(rng, ids)
    kept = KeptPlacement(engines, items, lpt_placement(items, engines, COST))
    plan = {tid: kept.ids[i] for tid, (_, _, i) in kept.placed.items()}
    for step in range(3):
        gone = rng.sample(sorted(kept.placed), len(kept.placed) // 5)
        stay = [tid for tid in sorted(kept.placed) if tid not in set(gone)]
        changed = _items(rng, rng.sample(stay, len(stay) // 4) + [f"n{step}-{i}" for i in range(7)])
        moved = kept.update(changed, gone, COST)
        assert set(moved) == {tid for tid, _, _ in changed}
        for tid in gone:
            assert tid not in kept.placed
            plan.pop(tid)
        for tid in set(stay) - set(moved):
            assert kept.ids[kept.placed[tid][2]] == plan[tid]  # kept its engine
        plan.update(moved)
        for (tid, rem, ctx) in changed:
            assert kept.placed[tid] == (rem, ctx, kept.ids.index(moved[tid]))
        for ld, fresh in zip(kept.loads, _loads_from_scratch(kept), strict=True):
            assert ld.head == fresh.head  # the longest member, exactly
            assert math.isclose(ld.tokens, fresh.tokens, rel_tol=1e-9, abs_tol=1e-6)
            assert math.isclose(ld.kv_tokens, fresh.kv_tokens, rel_tol=1e-9, abs_tol=1e-3)


def test_an_engine_emptied_holds_exact_zeros() -> None:
    engines = _engines((1, 1))
    items: list[Item] = [("a", 1000.0 / 3.0, 100.0), ("b", 10.0 / 7.0, 3.0)]
    kept = KeptPlacement(engines, items, {"a": "e000", "b": "e000"})
    kept.update([], ["a", "b"], COST)
    assert (kept.loads[0].head, kept.loads[0].tokens, kept.loads[0].kv_tokens) == (0, 0, 0)


def _treadle(n: int) -> Treadle:
    truth = {f"t{i:03d}": Outcome(f"g{i // 4}", 100, 300 + 97 * i, 1, 0.0) for i in range(n)}
    p = Treadle(COST, TruthEstimator(truth), prior_lengths=[], typical_context=1000.0,
                reconfigure=False)
    for i in range(4):
        p.on_event(EngineAdded(f"e{i}", 8, 1024, 10**9), 0.0)
    return p


def test_a_re_plan_places_only_the_arrivals_and_a_new_generation_places_all() -> None:
    p = _treadle(48)
    for i in range(40):
        p.on_event(TrajectoryArrived(f"t{i:03d}", f"g{i // 4}", 100), 0.0)
    p.decide(0.0)
    first = dict(p.target)
    assert len(first) == 40 and p.partial_replans == 0
    for i in range(40, 48):  # a few more arrive: placed on their own
        p.on_event(TrajectoryArrived(f"t{i:03d}", f"g{i // 4}", 100), 1.0)
    p.decide(1.0)
    assert p.partial_replans == 1 and p.replans == 2
    assert {tid: p.target[tid] for tid in first} == first  # the others stay
    assert set(p.target) == {f"t{i:03d}" for i in range(48)}
    p.decide(p.estimate_ttl_s)  # estimates renewed: everything placed afresh
    assert p.partial_replans == 1 and p.replans >= 3

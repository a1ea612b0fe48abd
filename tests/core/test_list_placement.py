"""treadle's list placement (`core.policies.list_placement`): its heap loop, written
out over columns for speed, places exactly as `_Load`'s own methods do."""

from __future__ import annotations

import heapq
import random

from treadle.core.cost_model import CostModel
from treadle.core.policies import list_placement as lp
from treadle.core.scheduler import EngineState

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

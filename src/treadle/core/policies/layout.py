"""Engine-pool layouts: how a GPU budget is split into engines of TP degrees 1-8,
and what a layout is worth for a batch of predicted trajectory lengths.

A layout is a tuple of TP degrees, largest first, e.g. (8, 8, 4, 1, 1, ...). Its
worth for a batch is the placement model's makespan (`core.placement`): group
completion C(g, e) = T_e · F_e(|g|) · max L over the presorted partition. The
batch is represented by its length quantiles, reduced to at most `MAX_ITEMS`
items of equal weight so that evaluating one layout costs about a millisecond.

`anneal_layout` is Heddle's resource manager: simulated annealing initialised
from a homogeneous pool, with moves that merge two equal engines or split one.
(treadle scores its candidate layouts with its own placement model instead; see
`list_placement.lpt_layout`.)
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.placement import EngineSlot, place

MAX_ITEMS = 128  # batch items a layout is evaluated on (quantile representatives)
Layout = tuple[int, ...]


def homogeneous_pool(gpus: int, tp: int, policy: str) -> list[int]:
    """As many TP-`tp` engines as fit; ValueError if not even one does."""
    if gpus < tp:
        raise ValueError(f"{policy}: {gpus} GPUs cannot hold one TP-{tp} engine")
    return [tp] * (gpus // tp)


def reduce_lengths(lengths: Sequence[float], items: int = MAX_ITEMS) -> tuple[list[float], int]:
    """Representative lengths (descending) and how many trajectories each stands for."""
    ordered = sorted(lengths, reverse=True)
    if len(ordered) <= items:
        return ordered, 1
    weight = math.ceil(len(ordered) / items)
    return [ordered[i] for i in range(0, len(ordered), weight)], weight


def engine_slot(cost: CostModel, engine_id: str, tp: int, context: float, max_batch: int,
                weight: int = 1) -> EngineSlot:
    """The placement model's view of one engine: per-token time of one item (a
    batch of `weight` trajectories of a typical `context`), and the interference
    factor F(b) of b such items relative to one (KV of the batch grows with it)."""
    base = cost.step_time(tp, weight, weight * context)  # one item: `weight` sequences
    cap = max(1, max_batch // weight)
    interference = tuple(
        cost.step_time(tp, b * weight, b * weight * context) / base for b in range(1, cap + 1)
    )
    return EngineSlot(engine_id, base, cap, interference)


def group_caps(kv_capacities: Sequence[int], context: float, trajectories: int,
               max_batch: int, watermark: float = 0.8) -> list[int]:
    """How many trajectories placement may give each engine: what its KV cache holds
    at a typical `context`, scaled up evenly when the whole batch does not fit (the
    excess then queues, in proportion to each engine's cache), never above the
    engine's `max_batch`. A placement blind to KV would pile hundreds of
    trajectories onto an engine whose cache holds a few dozen."""
    fit = [max(1, int(watermark * kv / max(context, 1.0))) for kv in kv_capacities]
    total = sum(fit)
    scale = max(1.0, trajectories / total) if total else 1.0
    return [min(max_batch, math.ceil(f * scale)) for f in fit]


@functools.lru_cache(maxsize=256)
def _shared_slot(cost: CostModel, tp: int, context: float, max_batch: int,
                 weight: int) -> EngineSlot:
    """One `engine_slot` for every engine of a degree: placement ignores the id, and
    an annealing run scores hundreds of layouts of the same few degrees (building a
    slot is `max_batch` step times)."""
    return engine_slot(cost, f"tp{tp}", tp, context, max_batch, weight)


def layout_makespan(layout: Layout, lengths: Sequence[float], cost: CostModel,
                    context: float, max_batch: int, weight: int = 1) -> float:
    """Placement-model makespan of `lengths` (descending, each of `weight`) on `layout`."""
    slots = [_shared_slot(cost, tp, context, max_batch, weight) for tp in layout]
    if sum(s.max_batch for s in slots) < len(lengths):
        return math.inf
    return place(lengths, slots).makespan


def anneal_layout(gpus: int, lengths: Sequence[float], cost: CostModel, context: float,
                  max_batch: int, *, start_tp: int, seed: int = 0, iterations: int = 400,
                  min_tp: int = 1) -> Layout:
    """Simulated annealing from the homogeneous TP-`start_tp` pool. A move merges two
    engines of the same degree into one of twice the degree, or splits one engine
    into two halves; worse layouts are accepted with the Metropolis probability
    under a geometric cooling schedule. Deterministic for a given seed."""
    rng = random.Random(seed)
    reduced, weight = reduce_lengths(lengths)

    def score(layout: Layout) -> float:
        return layout_makespan(layout, reduced, cost, context, max_batch, weight)

    current: Layout = (start_tp,) * (gpus // start_tp)
    current_cost = score(current)
    best, best_cost = current, current_cost
    temperature = 0.05 * (current_cost if math.isfinite(current_cost) else 1.0)
    for _ in range(iterations):
        candidate = _neighbour(current, rng, min_tp)
        if candidate is None:
            continue
        c = score(candidate)
        delta = c - current_cost
        if delta <= 0 or (math.isfinite(c) and temperature > 0
                          and rng.random() < math.exp(-delta / temperature)):
            current, current_cost = candidate, c
            if c < best_cost:
                best, best_cost = candidate, c
        temperature *= 0.99
    return best


def _neighbour(layout: Layout, rng: random.Random, min_tp: int) -> Layout | None:
    parts = list(layout)
    if rng.random() < 0.5:
        mergeable = sorted({d for d in parts if d < max(TP_DEGREES) and parts.count(d) >= 2})
        if not mergeable:
            return None
        d = rng.choice(mergeable)
        parts.remove(d)
        parts.remove(d)
        parts.append(2 * d)
    else:
        splittable = sorted({d for d in parts if d // 2 >= min_tp})
        if not splittable:
            return None
        d = rng.choice(splittable)
        parts.remove(d)
        parts += [d // 2, d // 2]
    return tuple(sorted(parts, reverse=True))

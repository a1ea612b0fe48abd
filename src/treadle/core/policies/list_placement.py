"""treadle's list placement (`Treadle` mechanism 2, in `treadle_policy`'s docstring):
longest-first placement of predicted remaining lengths, each on the engine whose
predicted finish with it stays lowest, and the layouts it ranks by the makespan it
predicts. Pure: no I/O, no clock."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.policies.layout import Layout, reduce_lengths
from treadle.core.scheduler import EngineState

TAIL_PER_ENGINE = 4  # trajectories per engine placed by exact evaluation
# At most this many placed by exact evaluation: past it, every engine holds one of
# the longest already and the rest go by the heap. Over 1,024 TP-1 engines a
# 4,000-trajectory batch's placement took ~0.4 s exact, ~0.05 s capped (the
# tail's engines keep their longest; `bench control-plane`).
TAIL_MAX = 1024
# Layouts within this share of the best model score count as tied (and the one with
# fewest engines wins). The model leaves out tool gaps, during which an engine
# serves others, and per-engine overheads; in simulation, mixed layouts whose model
# advantage was below ~12% did not finish sooner than the homogeneous TP-8 pool.
LAYOUT_TOLERANCE = 0.12


@dataclass(frozen=True, slots=True)
class Batch:
    """Trajectories to place, as columns (entry k of each is trajectory k): a re-plan
    of 100,000 trajectories builds three lists, not 100,000 tuples, which the cyclic
    collector would otherwise walk, inside the re-plan, until they die with it.

    Contract (ValueError otherwise): the three columns are equally long."""

    ids: Sequence[str]
    remaining: Sequence[float]  # predicted remaining tokens
    context: Sequence[float]  # context tokens now

    def __post_init__(self) -> None:
        if not len(self.ids) == len(self.remaining) == len(self.context):
            raise ValueError(f"a batch's columns differ in length: {len(self.ids)} ids, "
                             f"{len(self.remaining)} remaining, {len(self.context)} contexts")

    @classmethod
    def expected(cls, lengths: Sequence[float], context: float) -> Batch:
        """The batch a layout is ranked for: `lengths` reduced to representatives
        (`layout.reduce_lengths`), each standing for its weight in trajectories, all
        at one typical `context`."""
        reduced, weight = reduce_lengths(lengths)
        remaining = [length for length in reduced for _ in range(weight)]
        return cls([f"q{k:06d}" for k in range(len(remaining))], remaining,
                   [context] * len(remaining))


@dataclass(slots=True)
class _Load:
    """An engine's planned load, as seen by its longest trajectory.

    Co-runner i stays for min(1, Rᵢ/head) of the head's remaining time, at a mean
    context of ctxᵢ + Rᵢ/2; since no member is longer than the head, the weighted
    batch and KV are Σ Rᵢ / head and Σ Rᵢ(ctxᵢ + Rᵢ/2) / head, so two sums suffice
    and members can be added in any order."""

    tp: int
    head: float = 0.0  # predicted remaining tokens of its longest trajectory
    tokens: float = 0.0  # Σ Rᵢ
    kv_tokens: float = 0.0  # Σ Rᵢ(ctxᵢ + Rᵢ/2)

    def finish_with(self, cost: CostModel, remaining: float, context: float) -> float:
        """Predicted decode time of the engine's longest trajectory with one more."""
        head = max(self.head, remaining, 1.0)
        batch = (self.tokens + remaining) / head
        kv = (self.kv_tokens + remaining * (context + remaining / 2.0)) / head
        return head * cost.step_time(self.tp, max(1, round(batch)), kv)

    def finish(self, cost: CostModel) -> float:
        if self.head <= 0:
            return 0.0
        batch, kv = self.tokens / self.head, self.kv_tokens / self.head
        return self.head * cost.step_time(self.tp, max(1, round(batch)), kv)

    def add(self, remaining: float, context: float) -> None:
        self.head = max(self.head, remaining)
        self.tokens += remaining
        self.kv_tokens += remaining * (context + remaining / 2.0)


def lpt_makespan(batch: Batch, engines: Sequence[EngineState], cost: CostModel) -> float:
    """The list placement's predicted makespan (decode seconds) for `batch`."""
    loads = [_Load(e.tp) for e in engines]
    for i, rem, ctx in zip(lpt_placement(batch, engines, cost), batch.remaining, batch.context,
                           strict=True):
        loads[i].add(rem, ctx)
    return max((ld.finish(cost) for ld in loads), default=0.0)


def candidate_layouts(gpus: int, min_tp: int) -> list[Layout]:
    """Homogeneous pools, and k TP-8 engines beside a homogeneous lower tier."""
    degrees = [tp for tp in TP_DEGREES if tp >= min_tp and tp <= gpus]
    out: list[Layout] = [(tp,) * (gpus // tp) for tp in degrees]
    top = max(degrees)
    for low in degrees[:-1]:
        for k in range(1, gpus // top):
            rest = gpus - k * top
            out.append((top,) * k + (low,) * (rest // low))
    return out


def lpt_layout(gpus: int, lengths: Sequence[float], cost: CostModel, context: float,
               max_batch: int) -> Layout:
    """The candidate layout with the lowest list-placement makespan for `lengths`;
    among those within `LAYOUT_TOLERANCE` of the best, the one with fewest engines
    (the model leaves out per-engine overheads and tool gaps, so near-ties are
    noise, and a pool of fewer, larger engines gives every trajectory the fastest
    per-token time). When that is a homogeneous pool, the homogeneous pool the
    model scores best instead: the tolerance was set against mixed layouts, and
    applied between pools it made TP-8 win over a TP-4 pool the model scored up to
    12% faster, so the search missed the best homogeneous pool (with the calibrated
    cost model, TP-4 at 64 trajectories per engine: flat, coding and math at 4,096)."""
    batch = Batch.expected(lengths, context)
    scored: list[tuple[float, Layout]] = []
    for layout in candidate_layouts(gpus, cost.min_tp()):
        scored.append((lpt_makespan(batch, engines_of(layout, cost, max_batch), cost), layout))
    best = min(m for m, _ in scored)
    near = [(len(layout), m, layout) for m, layout in scored
            if m <= best * (1.0 + LAYOUT_TOLERANCE)]
    chosen = min(near)[2]
    if len(set(chosen)) > 1:
        return chosen
    # Exact ties between pools go to the larger degree (fewer engines), as before.
    return min((m, len(layout), layout) for m, layout in scored if len(set(layout)) == 1)[2]


def lpt_placement(batch: Batch, engines: Sequence[EngineState], cost: CostModel) -> list[int]:
    """Longest-first list placement of `batch`; returns each item's engine (an index
    into `engines`, in the batch's order). The tail (the `TAIL_PER_ENGINE`·m longest)
    is placed by exact evaluation of every engine, the rest by a heap keyed on a
    typical short trajectory. Deterministic: the order is by remaining tokens
    descending, ties by id (not by the batch's order), and ties between engines go to
    the lowest index. ValueError for a non-empty batch and no engines."""
    if not engines:
        if batch.ids:
            raise ValueError(f"no engines to place {len(batch.ids)} trajectories on")
        return []
    order = _longest_first(batch)
    remaining, context = batch.remaining, batch.context
    loads = [_Load(e.tp) for e in engines]
    engine_of = [0] * len(order)
    n_tail = min(len(order), TAIL_PER_ENGINE * len(engines), max(TAIL_MAX, len(engines)))
    tail = order[:n_tail]
    picks = _place_tail([(remaining[j], context[j]) for j in tail], loads, cost)
    for j, i in zip(tail, picks, strict=True):
        engine_of[j] = i
    rest = order[n_tail:]
    if rest:
        typ_rem = remaining[rest[len(rest) // 2]]
        typ_ctx = sum(context[j] for j in rest) / len(rest)
        heap = [(ld.finish_with(cost, typ_rem, typ_ctx), i) for i, ld in enumerate(loads)]
        heapq.heapify(heap)
        _place_rest(rest, remaining, context, loads, heap, engine_of, cost, typ_rem, typ_ctx)
    return engine_of


def _place_rest(rest: list[int], remaining: Sequence[float], context: Sequence[float],
                loads: list[_Load], heap: list[tuple[float, int]], engine_of: list[int],
                cost: CostModel, typ_rem: float, typ_ctx: float) -> None:
    """The heap part of `lpt_placement`: each of `rest` (longest first) to the engine at
    the top of `heap` (keyed on its finish with one more typical trajectory, as
    `_Load.finish_with` computes it), whose load takes it. This loop is most of a large
    batch's placement, so it is `_Load.add` and `finish_with` written out over columns
    (same arithmetic, same order: the same floats, so the same placement). `loads`
    are read, not updated."""
    heads = [ld.head for ld in loads]
    tokens = [ld.tokens for ld in loads]
    kv_tokens = [ld.kv_tokens for ld in loads]
    # (alpha, beta) of each engine's degree by batch, filled as batches come up.
    by_degree: dict[int, dict[int, tuple[float, float]]] = {}
    coeffs = [by_degree.setdefault(ld.tp, {}) for ld in loads]
    typ_kv = typ_rem * (typ_ctx + typ_rem / 2.0)
    floor = max(typ_rem, 1.0)
    step_coeffs, replace = cost.step_coeffs, heapq.heapreplace
    # One `heapreplace` for a pop and a push (the entries are distinct, so the heap
    # yields them in the same order).
    for j in rest:
        i = heap[0][1]
        rem = remaining[j]
        head = heads[i]
        if rem > head:
            head = heads[i] = rem
        total = tokens[i] = tokens[i] + rem
        kv = kv_tokens[i] = kv_tokens[i] + rem * (context[j] + rem / 2.0)
        engine_of[j] = i
        # finish_with(typ_rem, typ_ctx): max(head, typ_rem, 1.0) and the step time
        # at that batch (at least one) and KV, times the head.
        top = head if head > floor else floor
        batch = round((total + typ_rem) / top)
        ab = coeffs[i].get(batch)
        if ab is None:
            ab = coeffs[i][batch] = step_coeffs(loads[i].tp, batch if batch > 1 else 1)
        replace(heap, (top * (ab[0] + ab[1] * ((kv + typ_kv) / top)), i))


def _longest_first(batch: Batch) -> list[int]:
    """The batch's indices by remaining tokens descending, ties by id: sorted by id,
    then by length alone (a C key each); a sort is stable, `reverse` too, so equal
    lengths (siblings share a fresh estimate) stay in id order."""
    by_id = sorted(range(len(batch.ids)), key=batch.ids.__getitem__)
    return sorted(by_id, key=batch.remaining.__getitem__, reverse=True)


_LoadKey = tuple[int, float, float, float]  # a `_Load`'s whole state


def _place_tail(tail: Sequence[tuple[float, float]], loads: list[_Load],
                cost: CostModel) -> list[int]:
    """The engine index of each of `tail` ((remaining, context), longest first), each
    to the engine whose predicted finish with it is least (ties: the lowest index), as
    evaluating every engine would choose, without evaluating every engine:

    - engines in the same state (TP degree and planned load: all the empty ones of a
      degree, say, or those holding equal predictions) are interchangeable: only the
      lowest index of each such group is a candidate;
    - an engine already holds trajectories at least as long as the next one, so
      adding it keeps that engine's head and batch or raises them: its finish with
      it is at least its finish now plus the new trajectory's KV reads
      (β_tp · R · (ctx + R/2)), the same for every engine of its degree. Per degree,
      groups are visited in order of their finish now, and the search stops at the
      first whose bound (with its index) is past the best found. The bound is
      lowered by a relative 1e-12 so that float rounding never prunes a tie. An
      engine whose longest trajectory has under one token left (`finish_with`
      counts at least one) has no such bound: it is evaluated for every item.

    So a re-plan over m engines costs about O(m · k log m) for the k groups visited
    an item instead of O(m²) (`TAIL_PER_ENGINE` · m items, each against all m)."""

    def state(load: _Load) -> _LoadKey:
        return (load.tp, load.head, load.tokens, load.kv_tokens)

    groups: dict[_LoadKey, list[int]] = {}  # each a heap of engine indices
    for i, load in enumerate(loads):
        groups.setdefault(state(load), []).append(i)  # ascending: a heap already
    # Per degree: (finish now, the group's lowest index, its state); an entry whose
    # group no longer starts with that index is stale and skipped.
    heaps: dict[int, list[tuple[float, int, _LoadKey]]] = {}
    for key, members in groups.items():
        heaps.setdefault(key[0], []).append((loads[members[0]].finish(cost), members[0], key))
    for heap in heaps.values():
        heapq.heapify(heap)
    kv_s = {tp: cost.step_parts(tp).kv_s for tp in heaps}
    unbounded: set[int] = set()  # holding work whose head is under one token
    chosen: list[int] = []
    for rem, ctx in tail:
        best = (math.inf, -1)
        for i in unbounded:
            best = min(best, (loads[i].finish_with(cost, rem, ctx), i))
        for tp, heap in heaps.items():
            added = kv_s[tp] * rem * (ctx + rem / 2.0)
            visited: list[tuple[float, int, _LoadKey]] = []
            while heap:
                now, i, key = heap[0]
                group = groups.get(key)
                if not group or group[0] != i:
                    heapq.heappop(heap)  # the group changed since
                    continue
                if ((now + added) * (1.0 - 1e-12), i) > best:
                    break
                visited.append(heapq.heappop(heap))
                best = min(best, (loads[i].finish_with(cost, rem, ctx), i))
            for entry in visited:
                heapq.heappush(heap, entry)
        i = best[1]
        if i not in unbounded:
            key = state(loads[i])
            members = groups[key]
            heapq.heappop(members)  # i: only a group's lowest index is a candidate
            if members:
                heapq.heappush(heaps[key[0]], (loads[members[0]].finish(cost), members[0], key))
            else:
                del groups[key]
        loads[i].add(rem, ctx)
        if loads[i].head < 1.0:
            unbounded.add(i)
        else:
            unbounded.discard(i)
            key = state(loads[i])
            members = groups.setdefault(key, [])
            heapq.heappush(members, i)
            if members[0] == i:
                heapq.heappush(heaps[key[0]], (loads[i].finish(cost), i, key))
        chosen.append(i)
    return chosen


def engines_of(layout: Layout, cost: CostModel, max_batch: int) -> list[EngineState]:
    """The engines of `layout` as a list placement sees them (ids L000, L001, ...)."""
    return [EngineState(f"L{i:03d}", tp, max_batch, cost.kv_capacity_tokens(tp))
            for i, tp in enumerate(layout)]

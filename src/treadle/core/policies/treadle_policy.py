"""`treadle`: our own policy, built on the shared progressive machinery.

Mechanisms, in the order they act:

1. **Group-sibling prediction.** The predictor blends a trajectory's own progress
   with the finished (and still-running) lengths of its GRPO siblings (Seer's
   observation), so the long tail of a hard prompt is recognised as soon as its
   easy siblings finish. Heddle's predictor sees one trajectory at a time.
2. **Interference-aware list placement (LPT).** Heddle's placement model prices a
   group by its *size* only, F(|g|), at one typical context. But decode time is
   dominated by reading the batch's KV, and the long tail carries the longest
   contexts: isolating the long trajectories together makes their engine the
   slowest one. treadle instead places trajectories longest-first, each on the
   engine whose predicted finish stays lowest, where an engine's finish is its
   longest remaining trajectory times the step time of the batch it will carry
   (each co-runner weighted by the share of that time it stays, at its mean
   context while it does). The longest trajectories therefore spread out one per
   engine, fast engines first, and shorter ones fill the engines whose longest
   trajectory is shortest. Exact per-engine evaluation for the tail (the 4·m
   longest), a heap keyed on a typical short trajectory for the rest: O(n log m).
3. **Layout scored by simulating the step.** Candidate pools — every homogeneous
   TP degree, and every two-tier pool of k TP-8 engines beside engines of a lower
   degree — are ranked by the list placement's predicted makespan for the batch
   the previous rollout steps lead one to expect (their length quantiles). Given a
   `LayoutScorer` (the simulator's: `sim.layout_scoring`, which runs the expected
   batch through the step under the cost model, as the oracle does in hindsight
   with the true one), every homogeneous pool and the `SCORED_MIXED` best-ranked
   mixed pools are scored by it. The best-scored homogeneous pool is taken unless
   a mixed one scores `MIXED_MARGIN` lower: treadle's pool is never one the scorer
   rates below a homogeneous pool. Without a scorer the ranking alone decides
   (`lpt_layout`).
4. **Migration priced by the cost model.** In a tool gap a trajectory moves to its
   planned engine only if its predicted remaining tokens times the per-token time
   it saves exceeds, by `migration_margin`, the delay the move adds: the part of
   the KV transfer its tool call does not hide (`should_migrate`). Charging the
   whole transfer instead kept trajectories on overloaded engines behind long test
   runs that would have hidden it: on swe at 4,096 trajectories the hidden-part
   price finished 4–10% sooner over seeds 0–2, within ±1.8% elsewhere.
5. **Idle engines merged for the tail** (`tail_merge`, with `reconfigure`): once
   engines fall idle while long trajectories run on engines of a lower TP degree,
   idle ones are stopped and one engine of their summed degree started, when the
   cost model prices the tail's finish there (restart and KV moves included)
   `MERGE_MARGIN` sooner; the longest move to it, in a tool gap or out of a
   running turn. In simulation it pays on pools below TP 8 (pareto on 32 × TP 2:
   354.5 → 343.5 s); on the pools treadle chooses for the built-in workloads at 64
   H100s (TP 8, or TP 4 at 4,096 trajectories, where the placement keeps every
   engine busy to the end) nothing is merged.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.events import (
    EngineAdded,
    Event,
    ToolCallFinished,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnFinished,
)
from treadle.core.policies.layout import Layout, homogeneous_pool, reduce_lengths
from treadle.core.policies.progressive import Progressive, Staleness, WorkEstimator
from treadle.core.policies.tail_merge import Merge, plan_merge, tokens_left
from treadle.core.scheduler import EngineState, Phase, TrajState

TAIL_PER_ENGINE = 4  # trajectories per engine placed by exact evaluation
# At most this many placed by exact evaluation: past it, every engine holds one of
# the longest already and the rest go by the heap. Over 1,024 TP-1 engines a
# 4,000-trajectory batch's placement took ~0.4 s exact, ~0.05 s capped (the
# tail's engines keep their longest; `bench control-plane`).
TAIL_MAX = 1024
SCORED_MIXED = 2  # mixed pools a `LayoutScorer` scores beside the homogeneous ones
# How much lower than the best homogeneous pool's a mixed pool's score must be to be
# taken. The expected batch is other prompts of the distribution, and a mixed pool's
# edge depends on where the long trajectories land: on `short` at 256 trajectories
# (16 GPUs, seed 1) a TP-8 + 2 × TP-4 pool scored 2.3% below 2 × TP-8
# and ran the true batch 6.7% slower.
MIXED_MARGIN = 0.05
# Layouts within this share of the best model score count as tied (and the one with
# fewest engines wins). The model leaves out tool gaps, during which an engine
# serves others, and per-engine overheads; in simulation, mixed layouts whose model
# advantage was below ~12% did not finish sooner than the homogeneous TP-8 pool.
LAYOUT_TOLERANCE = 0.12
# Placement trust across RL steps (`Treadle.placement_fit`): the last FIT_WINDOW
# finished trajectories' predictions at arrival against their outcomes, in arrival
# order; below MIN_FIT correlation (of logs) over at least FIT_SAMPLES of them, the
# placement balances trajectories by count instead of by predicted length. At the
# end of 10 partial steps the fit was 0.80-0.90 on the suites, 0.28 on pareto,
# -0.04 on bimodal and -0.06 on flat.
FIT_WINDOW = 512
FIT_SAMPLES = 64
MIN_FIT = 0.3


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


def lpt_makespan(items: Sequence[tuple[str, float, float]], engines: Sequence[EngineState],
                 cost: CostModel) -> float:
    """The list placement's predicted makespan (decode seconds) for `items`."""
    plan = lpt_placement(items, engines, cost)
    loads = {e.engine_id: _Load(e.tp) for e in engines}
    for tid, rem, ctx in items:
        loads[plan[tid]].add(rem, ctx)
    return max((ld.finish(cost) for ld in loads.values()), default=0.0)


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
    reduced, weight = reduce_lengths(lengths)
    items = [(f"q{i:04d}-{k}", length, context)
             for i, length in enumerate(reduced) for k in range(weight)]
    scored: list[tuple[float, Layout]] = []
    for layout in candidate_layouts(gpus, cost.min_tp()):
        scored.append((lpt_makespan(items, _engines(layout, cost, max_batch), cost), layout))
    best = min(m for m, _ in scored)
    near = [(len(layout), m, layout) for m, layout in scored
            if m <= best * (1.0 + LAYOUT_TOLERANCE)]
    chosen = min(near)[2]
    if len(set(chosen)) > 1:
        return chosen
    # Exact ties between pools go to the larger degree (fewer engines), as before.
    return min((m, len(layout), layout) for m, layout in scored if len(set(layout)) == 1)[2]


def lpt_placement(items: Sequence[tuple[str, float, float]], engines: Sequence[EngineState],
                  cost: CostModel) -> dict[str, str]:
    """Longest-first list placement of (traj_id, remaining tokens, context) items;
    returns traj_id -> engine_id. The tail (the `TAIL_PER_ENGINE`·m longest) is
    placed by exact evaluation of every engine, the rest by a heap keyed on a
    typical short trajectory. Deterministic (ties by order and engine id)."""
    if not engines:
        return {}
    order = sorted(items, key=lambda it: (-it[1], it[0]))
    loads = [_Load(e.tp) for e in engines]
    out: dict[str, str] = {}
    n_tail = min(len(order), TAIL_PER_ENGINE * len(engines), max(TAIL_MAX, len(engines)))
    tail = order[:n_tail]
    for (tid, _, _), i in zip(tail, _place_tail(tail, loads, cost), strict=True):
        out[tid] = engines[i].engine_id
    rest = order[n_tail:]
    if rest:
        typ_rem = rest[len(rest) // 2][1]
        typ_ctx = sum(it[2] for it in rest) / len(rest)
        heap = [(ld.finish_with(cost, typ_rem, typ_ctx), i) for i, ld in enumerate(loads)]
        heapq.heapify(heap)
        for tid, rem, ctx in rest:
            _, i = heapq.heappop(heap)
            loads[i].add(rem, ctx)
            out[tid] = engines[i].engine_id
            heapq.heappush(heap, (loads[i].finish_with(cost, typ_rem, typ_ctx), i))
    return out


_LoadKey = tuple[int, float, float, float]  # a `_Load`'s whole state


def _place_tail(tail: Sequence[tuple[str, float, float]], loads: list[_Load],
                cost: CostModel) -> list[int]:
    """The engine index of each of `tail` (longest first), each to the engine whose
    predicted finish with it is least (ties: the lowest index), as evaluating every
    engine would choose, without evaluating every engine:

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
    for _, rem, ctx in tail:
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


class LayoutScorer(Protocol):
    """What running a rollout step on a pool would cost (lower is better), e.g. its
    makespan in a simulation of the batch one expects."""

    def __call__(self, layout: Layout) -> float: ...


def scored_candidates(gpus: int, lengths: Sequence[float], cost: CostModel, context: float,
                      max_batch: int) -> list[Layout]:
    """The pools a scorer decides between: every homogeneous pool that fits, then the
    `SCORED_MIXED` mixed pools the list placement ranks best for `lengths` (none
    without lengths)."""
    degrees = [tp for tp in TP_DEGREES if cost.min_tp() <= tp <= gpus]
    out: list[Layout] = [(tp,) * (gpus // tp) for tp in degrees]
    if lengths:
        reduced, weight = reduce_lengths(lengths)
        items = [(f"q{i:04d}-{k}", length, context)
                 for i, length in enumerate(reduced) for k in range(weight)]
        mixed = [(lpt_makespan(items, _engines(layout, cost, max_batch), cost), len(layout),
                  layout) for layout in candidate_layouts(gpus, cost.min_tp())
                 if len(set(layout)) > 1]
        out += [layout for _, _, layout in sorted(mixed)[:SCORED_MIXED]]
    return out


def _engines(layout: Layout, cost: CostModel, max_batch: int) -> list[EngineState]:
    return [EngineState(f"L{i:03d}", tp, max_batch, cost.kv_capacity_tokens(tp))
            for i, tp in enumerate(layout)]


class Treadle(Progressive):
    name = "treadle"
    migration_margin = 2.0  # saved time must exceed the move's cost by this factor

    def __init__(self, cost: CostModel, estimator: WorkEstimator, *,
                 prior_lengths: Sequence[float], typical_context: float,
                 max_batch: int = 1024, layout: Sequence[int] | None = None,
                 layout_scorer: LayoutScorer | None = None, replan_s: float = 15.0,
                 staleness: Staleness | None = None,
                 judge_estimator: WorkEstimator | None = None,
                 reconfigure: bool = True) -> None:
        super().__init__(cost, estimator, replan_s=replan_s, staleness=staleness,
                         judge_estimator=judge_estimator)
        self.reconfigure = reconfigure  # merge idle engines for the tail (`tail_merge`)
        self.merges: list[Merge] = []  # decided, in order
        self._starting: list[int] = []  # TP degrees of merged engines not yet added
        self.merged_engines: set[str] = set()  # engines a merge started
        self.prior_lengths = list(prior_lengths)
        self.typical_context = typical_context
        self.max_batch = max_batch
        self.layout = list(layout) if layout is not None else None
        self.layout_scorer = layout_scorer
        self.layout_scores: dict[Layout, float] = {}  # what the scorer said, if asked
        # Rollouts in arrival order with their prediction at arrival, and the
        # outcomes of those that finished; `_fit` takes them in arrival order, so a
        # window holds whole cohorts (a window by finish time holds, early in a
        # step, only the short ones, and there the correlation came out at -0.8 on
        # coding, whose predictions end the run at +0.8).
        self._arrivals: deque[tuple[str, float]] = deque()
        self._awaited: set[str] = set()  # in `_arrivals`, neither finished nor ended
        self._outcome: dict[str, float | None] = {}  # None: ended without finishing
        self._fit: deque[tuple[float, float]] = deque(maxlen=FIT_WINDOW)
        self.count_balanced = 0  # placements made by count (predictions untrusted)

    def initial_pool(self, gpus: int) -> list[int]:
        if self.layout is not None:
            return self.layout
        homogeneous_pool(gpus, self.cost.min_tp(), self.name)  # raises if nothing fits
        if self.layout_scorer is not None:
            candidates = scored_candidates(gpus, self.prior_lengths, self.cost,
                                           self.typical_context, self.max_batch)
            self.layout_scores = {layout: self.layout_scorer(layout) for layout in candidates}
            # Ties go to fewer, larger engines (the fastest per-token time).
            by_score = sorted(candidates, key=lambda c: (self.layout_scores[c], len(c), c))
            pool = min((c for c in by_score if len(set(c)) == 1),
                       key=lambda c: (self.layout_scores[c], len(c)))
            best = by_score[0]
            if self.layout_scores[best] < (1.0 - MIXED_MARGIN) * self.layout_scores[pool]:
                return list(best)
            return list(pool)
        if not self.prior_lengths:
            # Cold start, nothing known of the lengths: the largest TP degree that
            # fits gives every trajectory the fastest per-token time (and, with
            # weights sharded, the most KV per GPU).
            tp = max(d for d in TP_DEGREES if self.cost.min_tp() <= d <= gpus)
            return homogeneous_pool(gpus, tp, self.name)
        return list(lpt_layout(gpus, self.prior_lengths, self.cost, self.typical_context,
                               self.max_batch))

    def on_event(self, event: Event, now: float) -> None:
        super().on_event(event, now)
        if isinstance(event, EngineAdded) and event.tp in self._starting:
            self._starting.remove(event.tp)
            self.merged_engines.add(event.engine_id)
            self._next_replan = now  # place the tail on it now
        if self.staleness is not None and isinstance(event, TrajectoryArrived) \
                and not event.judge:
            self._arrivals.append((event.traj_id,
                                   self.est.estimate(event.traj_id).total_tokens))
            self._awaited.add(event.traj_id)

    def observe(self, event: Event, t: TrajState | None, now: float) -> None:
        if isinstance(event, TurnFinished | ToolCallFinished | TrajectoryEnded) \
                and event.traj_id in self._awaited:  # a rollout `_arrivals` holds
            if isinstance(event, TrajectoryEnded):
                self._awaited.discard(event.traj_id)
                self._outcome[event.traj_id] = None
            elif event.final and t is not None:
                self._awaited.discard(event.traj_id)
                self._outcome[event.traj_id] = float(t.output_tokens)
        super().observe(event, t, now)

    def _take_outcomes(self) -> None:
        """Move the finished head of `_arrivals` into `_fit` (those that ended
        without finishing are dropped); stop at the first still running."""
        while self._arrivals and self._arrivals[0][0] in self._outcome:
            tid, predicted = self._arrivals.popleft()
            actual = self._outcome.pop(tid)
            if actual is not None:
                self._fit.append((math.log1p(predicted), math.log1p(actual)))

    def placement_fit(self) -> float | None:
        """Correlation of log predicted (at arrival) and log actual output tokens
        over the last `FIT_WINDOW` finished trajectories; None with fewer than
        `FIT_SAMPLES` or no spread. Measured only across RL steps (with a
        `Staleness` policy)."""
        self._take_outcomes()
        if len(self._fit) < FIT_SAMPLES:
            return None
        xs, ys = zip(*self._fit, strict=True)
        try:
            return statistics.correlation(xs, ys)
        except statistics.StatisticsError:  # a constant series
            return None

    def replan(self, now: float) -> None:
        """Re-place, then merge idle engines for the tail where the cost model says
        it pays (`tail_merge.plan_merge`; one merge starting at a time)."""
        super().replan(now)
        if not self.reconfigure:
            return
        for t in [t for t in self.trajs.values() if t.phase is Phase.RUNNING]:
            dst = self.target.get(t.traj_id)
            if dst in self.merged_engines and dst != t.engine_id and self._move_pays(t, dst, now):
                self._move_running(t, dst, now)
        if self._starting:
            return
        live = [t for t in self.trajs.values() if t.phase is not Phase.DONE]
        merge = plan_merge(live, self.live_engines(), self.cost, self.remaining, now)
        if merge is None:
            return
        for eid in merge.drain:  # drained first: their GPUs are the new engine's
            self._drain(eid, now)
        self._add_engine(merge.tp)
        self._starting.append(merge.tp)
        self.merges.append(merge)

    def _move_pays(self, t: TrajState, dst: str, now: float) -> bool:
        """A running turn moves to a merged engine only if its tokens left times the
        per-token time it saves exceed `migration_margin` times the KV move, which
        it waits for (no tool call hides it)."""
        assert t.engine_id is not None
        s, d = self.engines[t.engine_id], self.engines[dst]
        ctx = float(t.context_tokens)
        before = self.cost.step_time(s.tp, len(s.running), float(s.kv_reserved))
        after = self.cost.step_time(d.tp, len(d.running) + 1, d.kv_reserved + ctx)
        left = tokens_left(t, self.remaining(t), before, now, self.cost.model.max_context)
        return left * (before - after) > self.migration_margin * self.cost.migration_time(ctx)

    def plan(self, live: list[TrajState], engines: list[EngineState]) -> dict[str, str]:
        """The list placement of predicted remaining lengths; across RL steps, by
        count when the predictions have not earned trust (`placement_fit` below
        `MIN_FIT`): a placement by wrong lengths gives some engines many more
        trajectories than others (pareto, partial: 208 trained tok/GPU-s by
        predicted length, 224 by count, 228 for verl@tp8 on the same pool)."""
        fit = self.placement_fit()
        by_count = fit is not None and fit < MIN_FIT
        if by_count:
            self.count_balanced += 1
        items = [(t.traj_id, 1.0 if by_count else max(1.0, self.remaining(t)),
                  float(t.context_tokens)) for t in live]
        return lpt_placement(items, engines, self.cost)

    def should_migrate(self, t: TrajState, src: str, dst: str, now: float) -> bool:
        """Move only if the predicted remaining tokens times the per-token time the
        move saves exceed `migration_margin` times the delay it adds: the part of
        the KV transfer that the tool call does not hide. The call's latency is
        taken as exponential with the trajectory's predicted mean per call (the
        least-informed law with that mean, and memoryless, so the time the call has
        already run does not matter): E[max(0, m − L)] = m − ℓ·(1 − e^(−m/ℓ))."""
        s, d = self.engines[src], self.engines[dst]
        ctx = float(t.context_tokens)
        before = self.cost.step_time(s.tp, len(s.running) + 1, s.kv_reserved + ctx)
        after = self.cost.step_time(d.tp, len(d.running) + 1, d.kv_reserved + ctx)
        saved = self.remaining(t) * (before - after)
        if saved <= 0:
            return False
        est = self.estimate(t)
        # A call follows every remaining turn but the last, and one is under way.
        calls = est.remaining_turns if t.phase is Phase.TOOL else est.remaining_turns - 1
        mean_call = est.remaining_tool_s / max(1.0, calls)
        move = self.cost.migration_time(ctx)
        exposed = move
        if mean_call > 0:
            exposed = move - mean_call * (1.0 - math.exp(-move / mean_call))
        return saved > self.migration_margin * exposed

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
   engine busy to the end) nothing is merged. A merged engine is split back into
   those it replaced at a step's end, or, where new trajectories arrive meanwhile,
   once the tail it was merged for has ended. It needs a driver that launches
   engines (`reconfigure=False` for one that does not).
"""

from __future__ import annotations

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
from treadle.core.policies.layout import Layout, homogeneous_pool
from treadle.core.policies.list_placement import (
    Batch,
    candidate_layouts,
    engines_of,
    lpt_layout,
    lpt_makespan,
    lpt_placement,
)
from treadle.core.policies.progressive import Progressive, Staleness, WorkEstimator
from treadle.core.policies.tail_merge import Merge, plan_merge, tokens_left
from treadle.core.scheduler import EngineState, Phase, TrajState

SCORED_MIXED = 2  # mixed pools a `LayoutScorer` scores beside the homogeneous ones
# How much lower than the best homogeneous pool's a mixed pool's score must be to be
# taken. The expected batch is other prompts of the distribution, and a mixed pool's
# edge depends on where the long trajectories land: on `short` at 256 trajectories
# (16 GPUs, seed 1) a TP-8 + 2 × TP-4 pool scored 2.3% below 2 × TP-8
# and ran the true batch 6.7% slower.
MIXED_MARGIN = 0.05
# Placement trust across RL steps (`Treadle.placement_fit`): the last FIT_WINDOW
# finished trajectories' predictions at arrival against their outcomes, in arrival
# order; below MIN_FIT correlation (of logs) over at least FIT_SAMPLES of them, the
# placement balances trajectories by count instead of by predicted length. At the
# end of 10 partial steps the fit was 0.80-0.90 on the suites, 0.28 on pareto,
# -0.04 on bimodal and -0.06 on flat.
FIT_WINDOW = 512
FIT_SAMPLES = 64
MIN_FIT = 0.3
GIVE_UP_RESTARTS = 10  # a merged engine not up in this many predicted restarts failed


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
        batch = Batch.expected(lengths, context)
        mixed = [(lpt_makespan(batch, engines_of(layout, cost, max_batch), cost), len(layout),
                  layout) for layout in candidate_layouts(gpus, cost.min_tp())
                 if len(set(layout)) > 1]
        out += [layout for _, _, layout in sorted(mixed)[:SCORED_MIXED]]
    return out


@dataclass(frozen=True, slots=True)
class MergedEngine:
    """An engine a merge started (`tail_merge`), until it is split back."""

    degrees: tuple[int, ...]  # TP degrees of the engines drained for it
    tail: frozenset[str]  # the trajectories it was merged for
    up_at: float  # when it was added


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
        # Merges whose engine is not added yet: each with the degrees of the engines
        # it drained and when it is given up.
        self._starting: list[tuple[Merge, tuple[int, ...], float]] = []
        self.merged_engines: dict[str, MergedEngine] = {}  # engines a merge started
        self._last_arrival = 0.0  # when the latest trajectory arrived
        self.splits = 0  # merged engines split back once their tail had ended
        # Trajectories arrived and not done: `self.trajs` keeps done ones too, and the
        # split looks at every decision while a merged engine is up.
        self._not_done: set[str] = set()
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
        if isinstance(event, EngineAdded):
            self._merged_engine_up(event, now)
        elif isinstance(event, TrajectoryArrived):
            self._not_done.add(event.traj_id)
            self._last_arrival = now
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
        if t is not None and t.phase is Phase.DONE:
            self._not_done.discard(t.traj_id)
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

    def _merged_engine_up(self, event: EngineAdded, now: float) -> None:
        """A merge's engine is up (the first of its degree added since): place the
        tail on it now."""
        starting = [s for s in self._starting if s[0].tp == event.tp]
        if starting:
            self._starting.remove(starting[0])
            merge, degrees, _ = starting[0]
            self.merged_engines[event.engine_id] = MergedEngine(degrees,
                                                                frozenset(merge.moved), now)
            self._next_replan = now

    def rebalance(self, now: float) -> None:
        super().rebalance(now)
        for eid, merged in sorted(self.merged_engines.items()):
            if not self._not_done or (self._last_arrival > merged.up_at
                                      and not merged.tail & self._not_done):
                self._split_back(eid, now)

    def _split_back(self, eid: str, now: float) -> None:
        """Split a merged engine back into those it replaced: at a synchronous step's
        end (no trajectory left: the trainer's turn), or once new trajectories have
        arrived since it came up and the tail it was merged for has ended (jobs
        that keep trajectories in flight). It is drained (what runs there finishes,
        or moves in a tool gap) and the engines it replaced start once its GPUs
        are free, so that the new bulk runs on the pool chosen for it. Not while
        only the old batch runs: a step's last trajectories keep the merged
        engine (splitting it early made a search step 15% slower in the
        simulator)."""
        merged = self.merged_engines.pop(eid)
        if eid in self.engines:
            self._drain(eid, now)
            for tp in merged.degrees:
                self._add_engine(tp)
            self.splits += 1

    def replan(self, now: float) -> None:
        """Re-place, then merge idle engines for the tail where the cost model says
        it pays (`tail_merge.plan_merge`; one merge starting at a time)."""
        super().replan(now)
        if not self.reconfigure:
            return
        running = [t for t in self.trajs.values()
                   if t.phase is Phase.RUNNING] if self.merged_engines else []
        for t in running:
            dst = self.target.get(t.traj_id)
            if dst in self.merged_engines and dst != t.engine_id and self._move_pays(t, dst, now):
                self._move_running(t, dst, now)
        # A merge whose engine is not up within GIVE_UP_RESTARTS of its predicted
        # restart failed to launch (the driver reports no failed start): merge again.
        self._starting = [s for s in self._starting if s[2] > now]
        if self._starting:
            return
        engines = self.live_engines()
        if sum(e.tp for e in engines if not e.running and not e.queue) < min(TP_DEGREES[1:]):
            return  # too few engines even without work to merge (`plan_merge` says no)
        live = [t for t in self.trajs.values() if t.phase is not Phase.DONE]
        merge = plan_merge(live, engines, self.cost, self.remaining, now)
        if merge is None:
            return
        degrees = tuple(self.engines[eid].tp for eid in merge.drain)
        for eid in merge.drain:  # drained first: their GPUs are the new engine's
            self._drain(eid, now)
        self._add_engine(merge.tp)
        give_up = now + GIVE_UP_RESTARTS * self.cost.restart_time(merge.tp)
        self._starting.append((merge, degrees, give_up))
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
        ids = [t.traj_id for t in live]
        remaining = [1.0] * len(live) if by_count else self.remaining_of(live)
        batch = Batch(ids, remaining, [float(t.context_tokens) for t in live])
        names = [e.engine_id for e in engines]
        return {tid: names[i]
                for tid, i in zip(ids, lpt_placement(batch, engines, self.cost), strict=True)}

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

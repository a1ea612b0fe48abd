"""A lower bound on the makespan of a rollout batch on a cluster.

No schedule — whatever its placement, priorities, preemptions, migrations or TP
layout, changed or not during the run — can finish the batch sooner than
`lower_bound(...)`, *under the engine cost model* (`core.cost_model`), which is the
physics the simulator runs. Notation: a decode step of a TP-t engine whose batch
has b sequences with K context tokens in all takes

    d = α_t(b) + β_t·K,   α_t(b) = max(w_t, κ_t·b) + ρ_t + σ_t·b     (`StepParts`)

(w: weight read, κ: GEMMs per sequence, ρ: fixed overhead and all-reduce latency,
σ: per-sequence overhead and all-reduce volume, β_t = β_1/t: reading one KV token).
A sequence of context c contributes c to K and gains one token per step. Three
terms; the bound is the largest.

**1. Critical path.** A trajectory's turns run one after another, each after the
previous tool call returns. A turn first prefills the tokens no cache can hold
(the prompt, or the observation just appended) and then samples its tokens one
step at a time. A step with batch b ≥ 1 and K ≥ c takes α_t(b) + β_t·K ≥ α_t(1) +
β_t·c, because α grows with b and other sequences only add KV. The token's time is
therefore at least min_t (α_t(1) + β_t·c), the lower envelope of four lines in c;
its integral over the turn's context range is exact and piecewise closed-form.
Prefill likewise takes at least min_t of its time on an idle engine (stalls for
other prefills only add). Tool latencies are fixed. The term is the largest such
sum over the batch.

**2. Total work.** Every GPU-second goes to decode steps or prefills (engines are
never faster than their cost). A decode step lasts at least its compute term plus
its KV term and occupies t GPUs, so per generated token the GPU-time is at least
2P/(F·e_c) + c·kv/(BW·e) — its share of the weight GEMMs plus the read of its own
context's KV, which batching cannot share. Each new (uncacheable) token must be
prefilled once, at no less than its FLOPs over the GPU's effective FLOP rate.
Dividing the total by the GPU count G bounds the makespan.

**3. Co-location (priced).** Terms 1 and 2 each see one resource. On a loaded
cluster the binding constraint is their coupling: a long trajectory's tokens are
fast only on a large-TP engine whose batch holds few other contexts, and such an
engine pays its weight read, t·w_t GPU-seconds a step, for few tokens. When dozens
of trajectories run to the context cap, they either share steps (and slow each
other by the KV they add) or each hold a fast engine (and spend GPU-time the rest
of the batch needs). Let T be any schedule's makespan and H any set of
trajectories (the "heavy" ones). Two facts hold:

(a) GPU-time: an engine runs its steps and prefills one at a time and the
    engines hold at most G GPUs at once, so Σ_steps t·d + PRE ≤ G·T, PRE being the
    GPU-seconds of the prefills (each at least min_t t·prefill(t, new, cached)).
(b) Latency: the steps a trajectory j ∈ H takes part in are disjoint in time, from
    each other, from its tool calls and from its own prefills, so
    Σ_{steps ∋ j} d ≤ T − tools_j − P_j (P_j: its prefills, each at least min_t).

For any λ, μ ≥ 0 with λ·G + μ·|H| = 1, λ·(a) + μ·Σ_{j∈H} (b) gives

    T ≥ λ·PRE + μ·Σ_{j∈H} (tools_j + P_j) + Σ_steps d·(λ·t + μ·h),

h being the number of heavy sequences in the step. Split each step's price over
its sequences. With h ≥ 1 heavy sequences (context X in all) and n others (Y),
α_t(h + n) ≥ α_t(h) + n·σ_t, so the step's price is at least

    (α_t(h) + β_t·X)(λt + μh) + (n·σ_t + β_t·Y)(λt + μh)
      = Σ_{heavy, context c} φ_H(c; t, h) + Σ_{others, context c} (λt + μh)(σ_t + β_t·c),
    φ_H(c; t, h) = (λt/h + μ)·α_t(h) + (λ·β_1 + μ·h·β_t)·c,

and a step with no heavy sequence (h = 0) costs λ·t·d ≥ Σ λ·(t·α_t(b)/b + β_1·c) ≥
Σ λ·(t·(κ_t + σ_t) + β_1·c) over its b sequences (t·κ_t = 2P/(F·e_c) for all t).
So every generated token pays at least the minimum of its share over the step
shapes it could be in: a heavy token φ*_H(c) = min over t and 1 ≤ h ≤ |H| of
φ_H(c; t, h), any other token φ*_O(c) = λβ_1c + min(λ·min_t t(κ_t + σ_t),
min_t ((λt + μ)σ_t + μβ_t c)). Summing over the batch's tokens, whose contexts
the batch alone fixes,

    T ≥ λ·PRE + μ·Σ_{j∈H} (tools_j + P_j) + Σ_{heavy tokens} φ*_H(c) + Σ_{other tokens} φ*_O(c).

φ_H charges both sides of co-location: a heavy token sharing its step with h − 1
others reads their KV (μ·h·β_t·c, counted from each one's side) but splits the
weight read h ways (λ·t·α_t(h)/h). With H = {the longest}, λ = 0 this is term 1;
with H = everything, μ = 0 it is term 2 plus the per-sequence overhead.

Computing it. φ*_H and φ*_O are minima of lines in c, hence concave, so on each
interval of a grid over the contexts they lie above their chord; integrating the
chords against the number of tokens decoded at each context keeps a lower bound,
and the chord weights of each trajectory are computed once. For fixed t and c,
φ_H(c; t, h) is convex in h (the max of two terms of the form A/h + B + C·h), so
its integer minimum lies next to a stationary point of one piece, the kink
w_t = κ_t·h, or an end of [1, |H|]: a handful of evaluations. The bound holds for
every λ and H, so the search only decides how tight it is: H is the k trajectories
with the longest critical paths for k on a geometric grid, and for each k the
right side, concave in λ (a sum of minima of affine functions), is maximised by
golden section over [0, 1/G], both ends included.

Limits: the bound ignores queueing, KV capacity, batch limits and restarts, so it
is not attainable in general; it is only as true as the cost model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from treadle.core.cost_model import TP_DEGREES, CostModel, StepParts

GRID_INTERVALS = 32  # chords over the context range (term 3)
GOLDEN_STEPS = 24  # golden-section steps on the GPU price (term 3)
HEAVY_GROWTH = 1.5  # ratio between successive heavy-set sizes tried (term 3)
_INV_PHI = (math.sqrt(5.0) - 1.0) / 2.0


class TurnShape(Protocol):
    @property
    def output_tokens(self) -> int: ...
    @property
    def tool_latency_s(self) -> float: ...
    @property
    def tool_output_tokens(self) -> int: ...


class TrajectoryShape(Protocol):
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def turns(self) -> Sequence[TurnShape]: ...


@dataclass(frozen=True, slots=True)
class LowerBound:
    """The bound and its three terms (seconds)."""

    critical_path_s: float  # the slowest trajectory alone on the fastest engine
    total_work_s: float  # GPU-seconds the batch needs, over the GPU count
    longest_traj_index: int  # which trajectory sets the critical path
    colocation_s: float = 0.0  # the priced bound on co-located long trajectories
    colocation_heavy: int = 0  # |H|: how many trajectories term 3 treats as heavy
    colocation_gpu_price: float = 0.0  # λ·G in [0, 1]: weight on GPU-time vs latency

    @property
    def makespan_s(self) -> float:
        return max(self.critical_path_s, self.total_work_s, self.colocation_s)


@dataclass(slots=True)
class _Shape:
    """What term 3 needs of one trajectory."""

    critical_path_s: float  # term 1 for this trajectory
    fixed_s: float  # its tool latencies plus its least prefill time
    chords: dict[int, float]  # grid index -> chord weight of its decoded tokens


def lower_bound(trajectories: Sequence[TrajectoryShape], cost: CostModel,
                gpus: int) -> LowerBound:
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    rates = _Rates(cost)
    top = max((_final_context(t) for t in trajectories), default=1.0)
    grid = [top * i / GRID_INTERVALS for i in range(GRID_INTERVALS + 1)]

    worst, worst_i, work, prefill_gpu = 0.0, -1, 0.0, 0.0
    shapes: list[_Shape] = []
    for i, traj in enumerate(trajectories):
        terms = rates.trajectory(traj, grid)
        shapes.append(terms.shape)
        work += terms.work_gpu_s
        prefill_gpu += terms.prefill_gpu_s
        if terms.shape.critical_path_s > worst:
            worst, worst_i = terms.shape.critical_path_s, i
    colocation, heavy, price = _priced_bound(shapes, grid, prefill_gpu,
                                             [cost.step_parts(tp) for tp in rates.degrees],
                                             gpus)
    return LowerBound(worst, work / gpus, worst_i, colocation, heavy, price)


@dataclass(frozen=True, slots=True)
class TrajectoryCost:
    """What one trajectory costs at the least, under the cost model (terms 1 and 2
    of the module docstring, for this trajectory alone)."""

    critical_path_s: float  # alone on the fastest engine: its prefills, decode, tools
    work_gpu_s: float  # GPU-seconds no schedule can spend less than on it


def trajectory_cost(traj: TrajectoryShape, cost: CostModel) -> TrajectoryCost:
    """Terms 1 and 2 for one trajectory; summing `work_gpu_s` over a batch and
    dividing by the GPU count gives term 2."""
    terms = _Rates(cost).trajectory(traj, None)
    return TrajectoryCost(terms.shape.critical_path_s, terms.work_gpu_s)


@dataclass(slots=True)
class _Terms:
    shape: _Shape  # what term 3 needs (critical path, fixed time, chords)
    work_gpu_s: float  # term 2's GPU-seconds
    prefill_gpu_s: float  # GPU-seconds of its prefills at the cheapest degree (term 3)


class _Rates:
    """The cost model's per-token figures that terms 1-3 use."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.degrees = [tp for tp in TP_DEGREES if tp >= cost.min_tp()]
        self.lines = [cost.step_coeffs(tp, 1) for tp in self.degrees]
        m, g, p = cost.model, cost.gpu, cost.params
        self.per_token_gpu_s = 2.0 * m.params / (g.bf16_flops * p.decode_flops_efficiency)
        self.kv_gpu_s = m.kv_bytes_per_token / (g.hbm_bw * p.hbm_efficiency)
        self.prefill_gpu_s = 2.0 * m.params / (g.bf16_flops * p.prefill_flops_efficiency)

    def trajectory(self, traj: TrajectoryShape, grid: Sequence[float] | None) -> _Terms:
        """One trajectory's terms; chord weights only with a `grid`."""
        cost, degrees = self.cost, self.degrees
        ctx = float(traj.prompt_tokens)
        new = float(traj.prompt_tokens)
        path = fixed = work = prefill_gpu = 0.0
        chords: dict[int, float] = {}
        for turn in traj.turns:
            prefill = min(cost.prefill_time(tp, new, ctx - new) for tp in degrees)
            path += prefill
            fixed += prefill + turn.tool_latency_s
            prefill_gpu += min(tp * cost.prefill_time(tp, new, ctx - new) for tp in degrees)
            work += new * self.prefill_gpu_s
            out = float(turn.output_tokens)
            path += _envelope_integral(self.lines, ctx, ctx + out)
            # Σ over the turn's tokens of their context: ctx, ctx+1, ... (continuous).
            work += out * self.per_token_gpu_s + self.kv_gpu_s * (out * ctx + out * out / 2.0)
            if grid is not None:
                _add_chords(chords, grid, ctx, ctx + out)
            ctx += out
            path += turn.tool_latency_s
            new = float(turn.tool_output_tokens)
            ctx += new
        return _Terms(_Shape(path, fixed, chords), work, prefill_gpu)


def _final_context(traj: TrajectoryShape) -> float:
    return float(traj.prompt_tokens + sum(t.output_tokens + t.tool_output_tokens
                                          for t in traj.turns))


def _add_chords(chords: dict[int, float], grid: Sequence[float], lo: float, hi: float) -> None:
    """Add the tokens decoded at contexts [lo, hi) to the chord weights: for a
    function f linear on each grid interval, Σ_i weight_i·f(x_i) = ∫_lo^hi f(c) dc."""
    step = grid[1] - grid[0]
    i = min(len(grid) - 2, max(0, int(lo / step) - 1))
    while i < len(grid) - 1 and grid[i] < hi:
        x0, x1 = grid[i], grid[i + 1]
        a, b = max(lo, x0), min(hi, x1)
        if b > a:
            d = x1 - x0
            chords[i] = chords.get(i, 0.0) + ((x1 - a) ** 2 - (x1 - b) ** 2) / (2.0 * d)
            chords[i + 1] = chords.get(i + 1, 0.0) + ((b - x0) ** 2 - (a - x0) ** 2) / (2.0 * d)
        i += 1


def _heavy_share(parts: Sequence[StepParts], c: float, lam: float, mu: float,
                 most: int) -> float:
    """φ*_H(c): the least price of a heavy token of context c, over TP degrees and
    1 ≤ h ≤ `most` heavy sequences in its step (see the module docstring)."""
    best = math.inf
    for s in parts:
        t, w, kappa, rho, sigma = s.tp, s.weights_s, s.compute_s, s.fixed_s, s.per_seq_s
        own = lam * s.kv_s * t * c  # λβ_1·c: reading its own KV
        others = mu * s.kv_s * c  # μβ_t·c per heavy sequence in the step
        # Weight-bound piece: λt(w+ρ)/h + (μσ + μβ_t·c)·h + const; compute-bound
        # piece: λtρ/h + (μ(κ+σ) + μβ_t·c)·h + const. Their stationary points, the
        # kink and the ends hold the integer minimum of the convex max.
        points = [1.0, float(most), w / kappa]
        for num, den in ((lam * t * (w + rho), mu * sigma + others),
                         (lam * t * rho, mu * (kappa + sigma) + others)):
            if num > 0 and den > 0:
                points.append(math.sqrt(num / den))
        tried: set[int] = set()
        for x in points:
            for h in (min(most, max(1, math.floor(x))), min(most, max(1, math.ceil(x)))):
                if h in tried:
                    continue
                tried.add(h)
                alpha = (w if w > kappa * h else kappa * h) + rho + sigma * h
                price = (lam * t / h + mu) * alpha + own + others * h
                if price < best:
                    best = price
    return best


def _other_share(parts: Sequence[StepParts], c: float, lam: float, mu: float) -> float:
    """φ*_O(c): the least price of a token of a trajectory outside H."""
    alone = lam * min(s.tp * (s.compute_s + s.per_seq_s) for s in parts)
    beside = min((lam * s.tp + mu) * s.per_seq_s + mu * s.kv_s * c for s in parts)
    return lam * parts[0].kv_s * parts[0].tp * c + min(alone, beside)


def _priced_bound(shapes: Sequence[_Shape], grid: Sequence[float], prefill_gpu: float,
                  parts: Sequence[StepParts], gpus: int) -> tuple[float, int, float]:
    """Term 3 maximised over the heavy-set sizes and λ; (bound, |H|, λ·G)."""
    n = len(shapes)
    if n == 0:
        return 0.0, 0, 0.0
    order = sorted(range(n), key=lambda i: (-shapes[i].critical_path_s, i))
    sizes: list[int] = []
    k = 1.0
    while round(k) < n:
        if not sizes or round(k) > sizes[-1]:
            sizes.append(round(k))
        k *= HEAVY_GROWTH
    sizes.append(n)
    # Chord weights of the k heaviest (prefix sums) and of the rest (suffix sums),
    # each summed directly so that no weight comes out of a subtraction.
    points = len(grid)
    heavy_at: dict[int, tuple[list[float], float]] = {}
    acc, fixed = [0.0] * points, 0.0
    wanted = set(sizes)
    for rank, i in enumerate(order, start=1):
        for j, w in shapes[i].chords.items():
            acc[j] += w
        fixed += shapes[i].fixed_s
        if rank in wanted:
            heavy_at[rank] = (list(acc), fixed)
    rest_at: dict[int, list[float]] = {n: [0.0] * points}
    acc = [0.0] * points
    for rank in range(n - 1, 0, -1):  # trajectories order[rank:] are the rest of top-rank
        for j, w in shapes[order[rank]].chords.items():
            acc[j] += w
        if rank in wanted:
            rest_at[rank] = list(acc)

    best = (0.0, 0, 0.0)
    for k in sizes:
        heavy, fixed_k = heavy_at[k]
        rest = rest_at[k]

        def value(lam: float, k: int = k, heavy: list[float] = heavy,
                  rest: list[float] = rest, fixed_k: float = fixed_k) -> float:
            mu = max(0.0, 1.0 - lam * gpus) / k
            total = lam * prefill_gpu + mu * fixed_k
            for x, wh, wo in zip(grid, heavy, rest, strict=True):
                if wh > 0:
                    total += wh * _heavy_share(parts, x, lam, mu, k)
                if wo > 0:
                    total += wo * _other_share(parts, x, lam, mu)
            return total

        lam, v = _golden_max(value, 0.0, 1.0 / gpus)
        if v > best[0]:
            best = (v, k, lam * gpus)
    return best


def _golden_max(f: Callable[[float], float], lo: float, hi: float) -> tuple[float, float]:
    """(argmax, max) of a concave f on [lo, hi] by golden section, ends included."""
    best = max((f(lo), lo), (f(hi), hi))
    a, b = lo, hi
    x1, x2 = b - _INV_PHI * (b - a), a + _INV_PHI * (b - a)
    f1, f2 = f(x1), f(x2)
    for _ in range(GOLDEN_STEPS):
        if f1 < f2:
            a, x1, f1 = x1, x2, f2
            x2 = a + _INV_PHI * (b - a)
            f2 = f(x2)
        else:
            b, x2, f2 = x2, x1, f1
            x1 = b - _INV_PHI * (b - a)
            f1 = f(x1)
    best = max(best, (f1, x1), (f2, x2))
    return best[1], best[0]


def _envelope_integral(lines: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """∫ from lo to hi of min over lines (a + b·c) dc — the lower envelope is concave
    and piecewise linear, so integrate between its breakpoints."""
    if hi <= lo:
        return 0.0
    cuts = {lo, hi}
    for i, (a1, b1) in enumerate(lines):
        for a2, b2 in lines[i + 1:]:
            if b1 != b2:
                c = (a2 - a1) / (b1 - b2)
                if lo < c < hi:
                    cuts.add(c)
    points = sorted(cuts)
    total = 0.0
    for x0, x1 in itertools.pairwise(points):
        mid = (x0 + x1) / 2.0
        a, b = min(lines, key=lambda ab: ab[0] + ab[1] * mid)
        total += a * (x1 - x0) + b * (x1 * x1 - x0 * x0) / 2.0
    return total

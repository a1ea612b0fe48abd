"""Placing trajectories on engine instances by presorted dynamic programming.

The model (Heddle's placement step): a group g of trajectories on engine e finishes
at::

    C(g, e) = T_e · F_e(|g|) · max_{τ∈g} L(τ)

with T_e the engine's per-token time at batch 1, F_e(b) ≥ 1 its interference factor
at batch b (F_e(1) = 1, non-decreasing) and L(τ) a trajectory's predicted remaining
length in tokens. The goal is the assignment with the smallest makespan, the
largest C over engines.

Sorting trajectories by L descending makes contiguous runs the natural groups: a
run's first item is its maximum, so its cost is known from its start and size.
Engines are taken in order of speed (T_e ascending, ties by list order) and engine
j receives the j-th run (possibly empty). Within that model:

* `place_exact_dp` is the linear-partition DP, D(i, j) = min_c max(D(i−c, j−1),
  C(items i−c+1..i, engine j)), in O(n · max_batch · m) time. Reference only.
* `place` finds the same optimum fast: the smallest target X for which a greedy
  fill (each engine, in speed order, takes as many of the next-longest items as
  fit under X) places everything. O(n log n + m · log(max_batch) · probes).
* `place_brute_force` tries every assignment; a test oracle for tiny inputs.

How exact the contiguous, speed-ordered model is:

* Identical engines (same T, F and max_batch): exact. Given any assignment, order
  its groups by their longest member and hand out the sorted items in runs of the
  same sizes; each run starts no earlier in the sorted order than its group's
  longest member did, so no group gets costlier.
* Heterogeneous engines: NOT always optimal. The argument above keeps the engine of
  each group but may need the engines in an order other than speed order. Example:
  fast T=1, F=(1, 2, 3); slow T=1.1, F=(1, 2, 3); lengths (10, 9, 9). Speed order
  gives at best 19.8 (fast {10}, slow {9, 9}); slow {10}, fast {9, 9} gives 18.
  This happens when the fast engine interferes steeply, or has a small max_batch,
  so it is better spent on many medium trajectories than on the single longest
  one; equally fast engines keep list order, which can be the wrong one too. In
  seeded random tiny cases (n ≤ 7, m ≤ 3) brute force beat the speed-ordered
  optimum in ~12% of cases, by up to 3.5×, with steep random F and max_batch;
  with gentle F (slope ≤ 0.05 a trajectory), T in {4.5, 8, 13} ms and random
  max_batch, in ~6%, by up to 1.19×. No bound is claimed. `place` equals
  `place_exact_dp` (the speed-ordered optimum) bit for bit, never the brute-force
  optimum where the two differ; the tests pin the example.

All costs go through `group_cost`, so the makespans of the three solvers are
computed with identical float arithmetic and compare exactly. Pure Python, no I/O,
no clock: `bench_placement` takes the clock as an argument.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSlot:
    """One engine instance as the placement sees it.

    Contract (checked on construction, ValueError otherwise): per_token_s is finite
    and > 0; max_batch ≥ 1; interference has exactly max_batch finite entries,
    starts at 1.0 and never decreases. F(1) = 1 keeps per_token_s the batch-1 time
    and makes "fastest" mean smallest per_token_s.
    """

    engine_id: str  # the engine's id, carried for the caller; placement ignores it
    per_token_s: float  # T_e: seconds per decoded token at batch 1
    max_batch: int  # most trajectories the engine may hold at once
    interference: tuple[float, ...]  # F_e(b) for b = 1..max_batch at index b-1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.per_token_s) and self.per_token_s > 0):
            raise ValueError(f"engine {self.engine_id!r}: per_token_s must be finite and > 0")
        if self.max_batch < 1:
            raise ValueError(f"engine {self.engine_id!r}: max_batch must be >= 1")
        f = self.interference
        if len(f) != self.max_batch:
            raise ValueError(
                f"engine {self.engine_id!r}: interference has {len(f)} entries, "
                f"max_batch is {self.max_batch}"
            )
        if f[0] != 1.0:
            raise ValueError(
                f"engine {self.engine_id!r}: interference[0] (F(1)) must be 1.0; "
                "fold a batch-1 factor into per_token_s"
            )
        for b in range(1, len(f)):
            if not math.isfinite(f[b]) or f[b] < f[b - 1]:
                raise ValueError(
                    f"engine {self.engine_id!r}: interference must be finite and "
                    f"non-decreasing (F({b + 1}) = {f[b]} after F({b}) = {f[b - 1]})"
                )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each trajectory goes and what that costs."""

    engine_of: tuple[int, ...]  # per input trajectory (input order): index into engines
    makespan: float  # max over engines of group_cost of its group; 0.0 for no input


def group_cost(engine: EngineSlot, count: int, max_length: float) -> float:
    """C(g, e) for a group of `count` trajectories whose longest is `max_length`.

    0.0 for an empty group. `count` must be within 0..max_batch (IndexError past
    it). The product is always evaluated as (T · F) · L; the solvers rely on that
    single formula to agree exactly.
    """
    if count <= 0:
        return 0.0
    return engine.per_token_s * engine.interference[count - 1] * max_length


# -- shared preparation --------------------------------------------------------------


def _prepare(
    lengths: Sequence[float], engines: Sequence[EngineSlot]
) -> tuple[list[int], list[float], list[int]]:
    """Validate, then return (items longest first, their lengths, engines fastest
    first). Both sorts are stable, so ties go by input index and engine order."""
    for i, length in enumerate(lengths):
        if not (math.isfinite(length) and length >= 0):
            raise ValueError(f"lengths[{i}] = {length!r}: must be finite and >= 0")
    n = len(lengths)
    capacity = sum(e.max_batch for e in engines)
    if n > capacity:
        raise ValueError(
            f"cannot place {n} trajectories: the {len(engines)} engines hold "
            f"{capacity} in total (sum of max_batch)"
        )
    items = sorted(range(n), key=lambda i: -lengths[i])
    sorted_lengths = [float(lengths[i]) for i in items]
    order = sorted(range(len(engines)), key=lambda k: engines[k].per_token_s)
    return items, sorted_lengths, order


def _assign(items: list[int], order: list[int], counts: list[int]) -> tuple[int, ...]:
    """Turn run sizes (per engine, in speed order) into engine_of in input order."""
    engine_of = [0] * len(items)
    p = 0
    for k, c in zip(order, counts, strict=True):
        for item in items[p : p + c]:
            engine_of[item] = k
        p += c
    return tuple(engine_of)


# -- fast exact solver ---------------------------------------------------------------


def _fill(
    target: float,
    sorted_lengths: list[float],
    speed_engines: list[EngineSlot],
    counts: list[int] | None,
) -> tuple[bool, float, float]:
    """Greedy fill under `target`: each engine in speed order takes the most of the
    next-longest items whose group cost stays <= target.

    Returns (everything placed, makespan of the fill, next event). The next event
    is the smallest target above `target` at which some engine on this fill would
    take one more item; below it the fill cannot change, so if this fill fails the
    optimum is at least that value. Writes run sizes into `counts` when given.

    Greedy is exact for a fixed engine order: by induction, after each engine it
    has placed at least as many items as any run partition feasible under target,
    since it starts no earlier (a no-longer first item) and costs are monotone in
    both group size and first length.
    """
    n = len(sorted_lengths)
    p = 0
    makespan = 0.0
    next_event = math.inf
    for j, e in enumerate(speed_engines):
        if p == n:
            if counts is not None:
                counts[j] = 0
            continue
        t = e.per_token_s
        f = e.interference
        length = sorted_lengths[p]
        top = min(e.max_batch, n - p)
        scale = t * length
        c = -1
        if scale > 0:
            # Fast path: bisect F against target / (T·L) in C, then confirm with the
            # exact (T·F)·L products; division rounding can be off by an entry.
            c = bisect_right(f, target / scale, 0, top)
            if (c > 0 and t * f[c - 1] * length > target) or (
                c < top and t * f[c] * length <= target
            ):
                c = -1
        if c < 0:
            # Exact bisect on the very products group_cost computes; handles flat F
            # near the threshold and zero lengths (every product is then 0).
            c = bisect_right(f, target, 0, top, key=lambda x: t * x * length)
        if c > 0:
            makespan = max(makespan, t * f[c - 1] * length)
        if c < top:
            next_event = min(next_event, t * f[c] * length)
        if counts is not None:
            counts[j] = c
        p += c
    return p == n, makespan, next_event


def place(lengths: Sequence[float], engines: Sequence[EngineSlot]) -> Placement:
    """Optimal placement in the contiguous, speed-ordered model; fast.

    Same makespan as `place_exact_dp` (exactly, same floats); the assignment is the
    greedy fill at that makespan, so faster engines take as many of the longest
    trajectories as fit and the longest trajectory (lowest index among equals) lands
    on the fastest engine (first in list among equally fast ones). Engines may be
    left empty. Deterministic. See the module docstring for when the model itself
    is not optimal (heterogeneous engines).

    Search: lo ≤ optimum ≤ hi always, both group-cost values. A probe between them
    either succeeds (hi drops to the fill's actual makespan, ≤ the probe) or fails
    (lo rises to the fill's next event, > the probe). Both move strictly over a
    finite set of costs, so the loop ends, at lo = hi = optimum.

    Raises ValueError for a negative or non-finite length, or if the engines hold
    fewer than len(lengths) trajectories in total.
    """
    items, sorted_lengths, order = _prepare(lengths, engines)
    if not items:
        return Placement((), 0.0)
    speed_engines = [engines[k] for k in order]
    # Unbounded target: each engine takes min(max_batch, rest); capacity was
    # checked, so this fills and gives a first upper bound.
    _, hi, _ = _fill(math.inf, sorted_lengths, speed_engines, None)
    # The longest item goes somewhere at cost >= T_e · L_1 >= T_fastest · L_1.
    lo = speed_engines[0].per_token_s * sorted_lengths[0]
    while lo < hi:
        # Geometric midpoint: costs span orders of magnitude (T, F and L multiply).
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2.0
        if not lo <= mid < hi:
            mid = lo  # adjacent floats; probing lo still makes progress
        ok, makespan, next_event = _fill(mid, sorted_lengths, speed_engines, None)
        if ok:
            hi = makespan
        else:
            lo = next_event
    counts = [0] * len(speed_engines)
    ok, makespan, _ = _fill(hi, sorted_lengths, speed_engines, counts)
    assert ok and makespan == hi  # the fill at an achieved makespan reproduces it
    return Placement(_assign(items, order, counts), makespan)


# -- reference solvers -------------------------------------------------------------------


def place_exact_dp(lengths: Sequence[float], engines: Sequence[EngineSlot]) -> Placement:
    """The linear-partition DP over sorted items and speed-ordered engines.

    O(n · max_batch · m) time, O(n · m) memory: a reference for small and medium
    inputs, too slow for thousands of trajectories on dozens of engines. Ties go to
    the run split that gives later (slower) engines fewer items. Same errors as
    `place`.
    """
    items, sorted_lengths, order = _prepare(lengths, engines)
    n = len(items)
    if n == 0:
        return Placement((), 0.0)
    # best[i]: smallest makespan placing the i longest items on the engines so far.
    best = [0.0] + [math.inf] * n
    choices: list[list[int]] = []
    for k in order:
        e = engines[k]
        new = [math.inf] * (n + 1)
        choice = [0] * (n + 1)
        for i in range(n + 1):
            for c in range(min(e.max_batch, i) + 1):
                prev = best[i - c]
                if prev == math.inf:
                    continue
                value = max(prev, group_cost(e, c, sorted_lengths[i - c]) if c else 0.0)
                if value < new[i]:
                    new[i], choice[i] = value, c
        best = new
        choices.append(choice)
    counts = [0] * len(order)
    i = n
    for j in range(len(order) - 1, -1, -1):
        counts[j] = choices[j][i]
        i -= counts[j]
    return Placement(_assign(items, order, counts), best[n])


BRUTE_FORCE_LIMIT = 2_000_000  # m**n assignments above which brute force refuses


def place_brute_force(lengths: Sequence[float], engines: Sequence[EngineSlot]) -> Placement:
    """Every assignment of trajectories to engines that respects max_batch; the
    first (lexicographic in engine index, input order) with the least makespan.

    Test oracle only: m**n assignments, refused (ValueError) above
    BRUTE_FORCE_LIMIT. Same errors as `place` otherwise.
    """
    _prepare(lengths, engines)  # validation and the capacity check
    n, m = len(lengths), len(engines)
    if n == 0:
        return Placement((), 0.0)
    if m**n > BRUTE_FORCE_LIMIT:
        raise ValueError(f"brute force over {m}**{n} assignments refused")
    best: tuple[float, tuple[int, ...]] | None = None
    for assignment in itertools.product(range(m), repeat=n):
        sizes = [0] * m
        longest = [0.0] * m
        for i, k in enumerate(assignment):
            sizes[k] += 1
            longest[k] = max(longest[k], float(lengths[i]))
        if any(sizes[k] > engines[k].max_batch for k in range(m)):
            continue
        makespan = max(group_cost(engines[k], sizes[k], longest[k]) for k in range(m))
        if best is None or makespan < best[0]:
            best = (makespan, assignment)
    assert best is not None  # capacity was checked, so some assignment fits
    return Placement(best[1], best[0])


# -- benchmark -------------------------------------------------------------------------


def bench_fleet(m: int) -> list[EngineSlot]:
    """A mixed fleet shaped like 64 engines = 4 fast (T=4.5 ms, max_batch 256),
    8 medium (T=8 ms, 192) and 52 slow (T=13 ms, 128), scaled to m; F(b) = 1 +
    (b−1)/40 for all, a linear interference in the batch size."""
    fast = max(1, m // 16) if m > 0 else 0
    medium = min(m - fast, m // 8)
    tiers = [(fast, 4.5e-3, 256), (medium, 8e-3, 192), (m - fast - medium, 13e-3, 128)]
    fleet: list[EngineSlot] = []
    for count, t, max_batch in tiers:
        curve = tuple(1.0 + b / 40.0 for b in range(max_batch))
        fleet.extend(EngineSlot(f"e{len(fleet)}", t, max_batch, curve) for _ in range(count))
    return fleet


def bench_placement(
    n: int,
    m: int,
    repeats: int,
    seed: int,
    clock: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Time `place` on `repeats` random instances of n trajectories on `bench_fleet(m)`.

    Lengths are log-normal remaining-token predictions (median ~3,000, clipped to
    16..32,768) drawn from random.Random(seed), one instance per repeat. `clock`
    is required (e.g. time.perf_counter): core code never reads the wall clock
    itself; None raises ValueError. Returns n, m, repeats and median/min/max ms of
    one `place` call, plus the median makespan in seconds.
    """
    if clock is None:
        raise ValueError("bench_placement needs a clock, e.g. clock=time.perf_counter")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    rng = random.Random(seed)
    engines = bench_fleet(m)
    times: list[float] = []
    makespans: list[float] = []
    for _ in range(repeats):
        lengths = [min(32768.0, max(16.0, rng.lognormvariate(8.0, 1.0))) for _ in range(n)]
        start = clock()
        result = place(lengths, engines)
        times.append((clock() - start) * 1e3)
        makespans.append(result.makespan)
    return {
        "n": float(n),
        "m": float(m),
        "repeats": float(repeats),
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "makespan_s": statistics.median(makespans),
    }

"""The makespan lower bound (`treadle.core.lower_bound`): the envelope integral
against numeric integration, the bound of hand-built trajectories against the cost
model, the co-location term's pieces against brute force, and — the contract that
matters — the bound never exceeds what any schedule achieves in the simulator: every
policy over a sweep of workloads, sizes, models and GPU counts, random schedules
that preempt and migrate, and every pinned schedule of tiny batches."""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.lower_bound import _envelope_integral, _heavy_share, _other_share, lower_bound
from treadle.core.policies import build_policy, parse_policy
from treadle.core.scheduler import EngineState, Phase, TrajectoryScheduler, TrajState
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, history_for, outcomes, simulate
from treadle.workloads import TrajectorySpec, TurnSpec, Workload, generate

POLICIES = ("slime", "verl", "verl-star", "heddle", "treadle", "oracle", "verl@tp8")


@functools.cache
def _cost(model: str = "qwen3-14b", gpu: str = "h100") -> CostModel:
    return CostModel.named(model, gpu)


def _numeric_envelope(lines: list[tuple[float, float]], lo: float, hi: float,
                      n: int = 4000) -> float:
    """Midpoint rule on min over lines; exact on linear pieces, O(h²) at kinks."""
    h = (hi - lo) / n
    return h * math.fsum(min(a + b * (lo + (i + 0.5) * h) for a, b in lines) for i in range(n))


def _traj(prompt: int, turns: list[tuple[int, float, int]], tid: str = "t0") -> TrajectorySpec:
    return TrajectorySpec(tid, "g0", prompt, tuple(TurnSpec(o, lat, obs) for o, lat, obs in turns))


# -- the envelope integral ---------------------------------------------------------------


def test_envelope_of_one_line_is_its_integral() -> None:
    a, b = 0.01, 1e-7
    lo, hi = 300.0, 9000.0
    expected = a * (hi - lo) + b * (hi * hi - lo * lo) / 2
    assert _envelope_integral([(a, b)], lo, hi) == pytest.approx(expected, rel=1e-12)


def test_envelope_of_an_empty_or_reversed_range_is_zero() -> None:
    lines = [(0.01, 1e-7), (0.005, 3e-7)]
    assert _envelope_integral(lines, 100.0, 100.0) == 0.0
    assert _envelope_integral(lines, 200.0, 100.0) == 0.0


def test_envelope_of_crossing_lines_by_hand() -> None:
    # min(1 + 0·c, 0 + 1·c) over [0, 2]: c on [0, 1], then 1 on [1, 2] → 0.5 + 1.
    assert _envelope_integral([(1.0, 0.0), (0.0, 1.0)], 0.0, 2.0) == pytest.approx(1.5)
    # Order of the lines does not matter.
    assert _envelope_integral([(0.0, 1.0), (1.0, 0.0)], 0.0, 2.0) == pytest.approx(1.5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 5),
       lo=st.floats(0.0, 5e4), span=st.floats(1.0, 2e5))
def test_envelope_equals_numeric_integration_of_the_min(seed: int, k: int, lo: float,
                                                        span: float) -> None:
    rng = random.Random(seed)
    # Lines shaped like the cost model's: cheaper fixed cost ↔ steeper KV slope,
    # so the envelope has real breakpoints inside the range.
    lines = [(rng.uniform(1e-3, 3e-2), rng.uniform(1e-9, 2e-7)) for _ in range(k)]
    hi = lo + span
    exact = _envelope_integral(lines, lo, hi)
    numeric = _numeric_envelope(lines, lo, hi)
    assert exact == pytest.approx(numeric, rel=1e-6)
    # Never above any single line's integral.
    for a, b in lines:
        assert exact <= (a * (hi - lo) + b * (hi * hi - lo * lo) / 2) * (1 + 1e-12)


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-14b", "qwen3-32b"])
def test_envelope_of_the_cost_model_lines(model: str) -> None:
    cost = _cost(model)
    lines = [cost.step_coeffs(tp, 1) for tp in TP_DEGREES]
    for lo, hi in ((0.0, 40960.0), (1000.0, 1001.0), (5e4, 2e6)):
        assert _envelope_integral(lines, lo, hi) == pytest.approx(
            _numeric_envelope(lines, lo, hi), rel=1e-7)


# -- hand-built trajectories ---------------------------------------------------------------


@pytest.mark.parametrize(("model", "prompt", "out"), [
    ("qwen3-14b", 700, 5000), ("qwen3-8b", 2000, 1), ("qwen3-32b", 3000, 30000),
])
def test_one_turn_bound_is_prefill_plus_batch_one_decode_on_the_best_tp(model: str, prompt: int,
                                                                       out: int) -> None:
    cost = _cost(model)
    degrees = [tp for tp in TP_DEGREES if tp >= cost.min_tp()]
    per_tp = {tp: cost.prefill_time(tp, prompt) + cost.decode_time(tp, 1, prompt, out)
              for tp in degrees}
    best = min(per_tp, key=lambda tp: per_tp[tp])
    # Precondition of the closed form: one degree is best for both prefill and every
    # context of the turn (the envelope is a single line).
    assert best == min(degrees, key=lambda tp: cost.prefill_time(tp, prompt))
    for c in (prompt, prompt + out):
        assert best == min(degrees, key=lambda tp: cost.step_time(tp, 1, c))
    lb = lower_bound([_traj(prompt, [(out, 0.0, 0)])], cost, gpus=8)
    assert lb.critical_path_s == pytest.approx(per_tp[best], rel=1e-9)
    assert lb.longest_traj_index == 0


def test_multi_turn_bound_adds_cached_prefills_decodes_and_tool_latencies() -> None:
    cost = _cost()
    turns = [(1200, 2.5, 300), (400, 0.75, 50), (900, 0.0, 0)]
    traj = _traj(800, turns)
    expected, ctx, new = 0.0, 800.0, 800.0
    for out, latency, obs in turns:
        expected += min(cost.prefill_time(tp, new, ctx - new) for tp in TP_DEGREES)
        expected += min(cost.decode_time(tp, 1, ctx, out) for tp in TP_DEGREES)
        expected += latency
        ctx += out + obs
        new = obs
    lb = lower_bound([traj], cost, gpus=8)
    assert lb.critical_path_s == pytest.approx(expected, rel=1e-9)
    # Tool time adds one for one.
    slower = _traj(800, [(1200, 12.5, 300), (400, 0.75, 50), (900, 0.0, 0)])
    assert lower_bound([slower], cost, 8).critical_path_s - lb.critical_path_s == pytest.approx(
        10.0, rel=1e-9)


def test_total_work_term_by_hand_and_scaling_with_gpus() -> None:
    cost = _cost()
    m, g, p = cost.model, cost.gpu, cost.params
    traj = _traj(1000, [(2000, 1.0, 100), (500, 0.0, 0)])
    per_token = 2.0 * m.params / (g.bf16_flops * p.decode_flops_efficiency)
    kv = m.kv_bytes_per_token / (g.hbm_bw * p.hbm_efficiency)
    prefill = 2.0 * m.params / (g.bf16_flops * p.prefill_flops_efficiency)
    work = (1000 * prefill + 2000 * per_token + kv * (2000 * 1000 + 2000**2 / 2)
            + 100 * prefill + 500 * per_token + kv * (500 * 3100 + 500**2 / 2))
    assert lower_bound([traj], cost, 1).total_work_s == pytest.approx(work, rel=1e-12)
    assert lower_bound([traj], cost, 16).total_work_s == pytest.approx(work / 16, rel=1e-12)


def test_critical_path_is_the_longest_trajectory_and_index_points_to_it() -> None:
    cost = _cost()
    trajs = [_traj(500, [(100, 0.0, 0)], "a"), _traj(500, [(9000, 0.0, 0)], "b"),
             _traj(500, [(300, 1.0, 10), (100, 0.0, 0)], "c")]
    lb = lower_bound(trajs, cost, 8)
    assert lb.longest_traj_index == 1
    assert lb.critical_path_s == pytest.approx(lower_bound([trajs[1]], cost, 8).critical_path_s)
    assert lb.makespan_s == max(lb.critical_path_s, lb.total_work_s, lb.colocation_s)


def test_bound_rejects_no_gpus() -> None:
    with pytest.raises(ValueError, match="gpus"):
        lower_bound([_traj(10, [(10, 0.0, 0)])], _cost(), 0)


def test_bound_is_tight_for_one_trajectory_alone_on_the_fastest_engine() -> None:
    """One trajectory on one TP-8 engine (the envelope's only line for this model)
    runs exactly the bound's critical path: the simulator and the bound use the same
    physics, and neither adds nor drops a term."""
    cost = _cost()
    traj = _traj(900, [(3000, 1.5, 400), (700, 0.25, 60), (1500, 0.0, 0)])
    report, _ = simulate(Workload("one", (traj,)), "verl@tp8", cost, 8)
    lb = lower_bound([traj], cost, 8)
    assert report.makespan_s == pytest.approx(lb.critical_path_s, rel=1e-6)
    assert report.ratio_to_lower_bound == pytest.approx(1.0, rel=1e-6)


# -- the bound against the simulator -----------------------------------------------------------

# (workload, trajectories, GPUs, seed, warm, model, GPU type): warm runs give the
# predictors the previous step's outcomes, so heddle and treadle plan mixed-TP pools
# from them. The loaded cases (many trajectories per GPU) are where the co-location
# term binds.
BASE = ("qwen3-14b", "h100")
CASES = [
    *((name, n, gpus, 0, False, *BASE) for name in ("coding", "search", "math", "swe")
      for n, gpus in ((32, 8), (64, 16))),
    *((name, 32, 8, 1, True, *BASE) for name in ("coding", "search", "math", "swe")),
    ("coding", 64, 16, 2, True, *BASE), ("search", 64, 8, 3, False, *BASE),
    ("math", 64, 8, 4, False, *BASE), ("swe", 32, 16, 5, False, *BASE),
    ("coding", 256, 8, 0, True, *BASE), ("math", 128, 8, 1, True, *BASE),
    ("math", 256, 16, 2, True, "qwen3-8b", "h100"),
    ("coding", 128, 16, 3, True, "qwen3-32b", "h200"),
    ("search", 128, 8, 4, True, "qwen3-8b", "h200"),
    ("swe", 64, 8, 5, True, "qwen3-32b", "h100"),
    ("math", 256, 32, 6, False, "qwen3-14b", "h200"),
    ("coding", 256, 8, 7, True, "qwen3-8b", "h100"),
]


@pytest.mark.parametrize(("name", "n", "gpus", "seed", "warm", "model", "gpu"), CASES)
def test_bound_never_exceeds_any_policys_simulated_makespan(name: str, n: int, gpus: int,
                                                           seed: int, warm: bool, model: str,
                                                           gpu: str) -> None:
    cost = _cost(model, gpu)
    workload = generate(name, n, seed=seed, group_size=16)
    history = history_for(name, n, seed) if warm else []
    lb = lower_bound(workload.trajectories, cost, gpus)
    assert lb.critical_path_s > 0 and lb.total_work_s > 0
    for policy in POLICIES:
        report, result = simulate(workload, policy, cost, gpus, history=history, seed=seed,
                                  bound=lb)
        assert result.makespan_s >= lb.critical_path_s * (1 - 1e-9), policy
        assert result.makespan_s >= lb.total_work_s * (1 - 1e-9), policy
        assert result.makespan_s >= lb.colocation_s * (1 - 1e-9), policy
        assert report.ratio_to_lower_bound >= 1 - 1e-9, policy
        # Stronger form of the work term: the GPU-seconds engines were busy cover it.
        assert result.engine_gpu_busy_s >= lb.total_work_s * gpus * (1 - 1e-9), policy


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("name", "seed"), [("swe", 1), ("coding", 3)])
def test_every_trajectory_finishes_no_sooner_than_its_own_critical_path(policy: str, name: str,
                                                                        seed: int) -> None:
    cost = _cost()
    workload = generate(name, 32, seed=seed)
    spec = parse_policy(policy)
    truth = dict(zip((t.traj_id for t in workload.trajectories), outcomes(workload),
                     strict=True))
    sched = build_policy(spec, cost, batch_size=32, history=history_for(name, 32, seed),
                         truth=truth if spec.name == "oracle" else None, seed=seed,
                         max_batch=MAX_BATCH)
    pool: list[int] = sched.initial_pool(8)  # type: ignore[attr-defined]
    cluster = Cluster(cost, 8, sched, list(workload.trajectories), pool, max_batch=MAX_BATCH)
    cluster.run()
    for traj in workload.trajectories:
        finished = cluster.trajs[traj.traj_id].finished_at
        assert finished is not None
        own = lower_bound([traj], cost, 8).critical_path_s
        assert finished >= own * (1 - 1e-9), traj.traj_id


# -- the co-location term ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(lam=st.floats(0.0, 1.0), c=st.floats(1.0, 2e5), most=st.integers(1, 300),
       model=st.sampled_from(["qwen3-8b", "qwen3-14b", "qwen3-32b"]))
def test_heavy_share_is_the_least_price_over_every_batch_size(lam: float, c: float, most: int,
                                                              model: str) -> None:
    cost = _cost(model)
    gpus = 64
    lam /= gpus
    mu = (1.0 - lam * gpus) / most
    parts = [cost.step_parts(tp) for tp in TP_DEGREES if tp >= cost.min_tp()]
    brute = min((lam * s.tp / h + mu) * s.alpha(h) + (lam * s.kv_s * s.tp + mu * h * s.kv_s) * c
                for s in parts for h in range(1, most + 1))
    assert _heavy_share(parts, c, lam, mu, most) == pytest.approx(brute, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), tp=st.sampled_from(TP_DEGREES), lam=st.floats(0.0, 1.0),
       heavy=st.integers(0, 40), others=st.integers(0, 200), population=st.integers(1, 60))
def test_a_steps_price_covers_the_least_shares_of_its_tokens(
        data: st.DataObject, tp: int, lam: float, heavy: int, others: int,
        population: int) -> None:
    """The lemma the co-location term rests on: whatever a step holds, its price
    d·(λt + μh) is at least the sum of its tokens' least shares."""
    if heavy + others == 0 or heavy > population:
        return
    cost = _cost()
    gpus = 64
    lam /= gpus
    mu = (1.0 - lam * gpus) / population
    contexts = st.floats(1.0, 40960.0)
    heavy_ctx = [data.draw(contexts) for _ in range(heavy)]
    other_ctx = [data.draw(contexts) for _ in range(min(others, 20))]
    other_ctx += other_ctx[:1] * (others - len(other_ctx))
    step = cost.step_time(tp, heavy + others, sum(heavy_ctx) + sum(other_ctx))
    price = step * (lam * tp + mu * heavy)
    parts = [cost.step_parts(d) for d in TP_DEGREES]
    shares = (sum(_heavy_share(parts, c, lam, mu, population) for c in heavy_ctx)
              + sum(_other_share(parts, c, lam, mu) for c in other_ctx))
    assert price >= shares * (1 - 1e-12)


def test_colocation_term_contains_both_simple_terms() -> None:
    """With one heavy trajectory and no GPU price it is the critical path (up to
    the chords), with every trajectory heavy and no latency price at least the total
    work."""
    cost = _cost()
    one = lower_bound([_traj(700, [(30000, 1.0, 500), (8000, 0.0, 0)])], cost, 8)
    assert one.colocation_s == pytest.approx(one.critical_path_s, rel=2e-3)
    for name, n, gpus in (("coding", 64, 1), ("math", 256, 2), ("swe", 64, 4)):
        lb = lower_bound(generate(name, n, seed=0).trajectories, cost, gpus)
        assert lb.colocation_s >= lb.total_work_s * (1 - 1e-12), name


def test_colocation_term_binds_when_many_trajectories_run_to_the_cap() -> None:
    """256 coding trajectories on 8 GPUs: a dozen near the 40K cap must share one
    TP-8 engine (or hold slower ones), which neither simple term sees."""
    lb = lower_bound(generate("coding", 256, seed=0).trajectories, _cost(), 8)
    assert lb.colocation_s > 1.3 * max(lb.critical_path_s, lb.total_work_s)
    assert lb.makespan_s == lb.colocation_s
    assert lb.colocation_heavy > 1 and 0.0 < lb.colocation_gpu_price < 1.0


# -- the bound against schedules no policy would choose ---------------------------------------


class FakeRandomScheduler(TrajectoryScheduler):
    """Test double: a seeded random schedule — random pool, routing, priorities and
    per-engine admission caps, and at every decision random preemptions and
    migrations in tool gaps. Useless as a policy; as a test it walks the simulator
    through schedules no policy produces."""

    name = "fake-random"

    def __init__(self, seed: int, degrees: Sequence[int]) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.degrees = list(degrees)
        self.caps: dict[str, int] = {}

    def initial_pool(self, gpus: int) -> list[int]:
        pool: list[int] = []
        while True:
            fits = [d for d in self.degrees if sum(pool) + d <= gpus]
            if not fits or (pool and self.rng.random() < 0.15):
                return pool
            pool.append(self.rng.choice(fits))

    def route(self, t: TrajState, now: float) -> str:
        return self.rng.choice(sorted(e.engine_id for e in self.live_engines()))

    def priority(self, t: TrajState, now: float) -> float:
        return self.rng.random()

    def admission_cap(self, e: EngineState) -> int:
        if e.engine_id not in self.caps:
            self.caps[e.engine_id] = self.rng.choice([1, 2, 3, 8, e.max_batch])
        return self.caps[e.engine_id]

    def rebalance(self, now: float) -> None:
        engines = sorted(self.engines)
        for t in sorted(self.trajs.values(), key=lambda t: t.traj_id):
            if t.phase is Phase.RUNNING and self.rng.random() < 0.05:
                self._preempt(t, now)
            elif (t.phase is Phase.TOOL and t.engine_id is not None and len(engines) > 1
                    and self.rng.random() < 0.3):
                self._migrate(t, self.rng.choice([e for e in engines if e != t.engine_id]))


@pytest.mark.parametrize(("name", "n", "gpus", "model"), [
    ("coding", 48, 8, "qwen3-14b"), ("math", 64, 8, "qwen3-8b"),
    ("swe", 32, 8, "qwen3-32b"), ("search", 48, 4, "qwen3-14b"),
])
@pytest.mark.parametrize("seed", range(4))
def test_bound_holds_for_random_schedules(name: str, n: int, gpus: int, model: str,
                                          seed: int) -> None:
    cost = _cost(model)
    workload = generate(name, n, seed=seed)
    lb = lower_bound(workload.trajectories, cost, gpus)
    sched = FakeRandomScheduler(seed, [d for d in TP_DEGREES if d >= cost.min_tp()])
    pool = sched.initial_pool(gpus)
    result = Cluster(cost, gpus, sched, list(workload.trajectories), pool,
                     max_batch=MAX_BATCH).run()
    assert result.makespan_s >= lb.makespan_s * (1 - 1e-9), (pool, sched.migrations)


class FakePinnedScheduler(TrajectoryScheduler):
    """Test double: every turn of trajectory i on engine `engine_of[i]` (in order of
    the engines' ids), FCFS or in a fixed priority order, at most `cap` at once."""

    name = "fake-pinned"

    def __init__(self, engine_of: Sequence[int], order: Sequence[int], cap: int) -> None:
        super().__init__()
        self.engine_of, self.order, self.cap = list(engine_of), list(order), cap

    def route(self, t: TrajState, now: float) -> str:
        return sorted(self.engines)[self.engine_of[int(t.traj_id[1:])]]

    def priority(self, t: TrajState, now: float) -> float:
        return float(self.order.index(int(t.traj_id[1:])))

    def admission_cap(self, e: EngineState) -> int:
        return self.cap


def _layouts(gpus: int, degrees: Sequence[int]) -> list[tuple[int, ...]]:
    """Every pool of the given degrees that uses all the GPUs, largest first."""
    if gpus == 0:
        return [()]
    return sorted({tuple(sorted((d, *rest), reverse=True))
                   for d in degrees if d <= gpus for rest in _layouts(gpus - d, degrees)})


def _pinned_schedules(n: int, layout: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
    """(engine of each trajectory, cap) up to swapping engines of one degree."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for engine_of in itertools.product(range(len(layout)), repeat=n):
        key = tuple(sorted((layout[e], tuple(i for i in range(n) if engine_of[i] == e))
                           for e in set(engine_of)))
        if key not in seen:
            seen.add(key)
            out += [(engine_of, 1), (engine_of, MAX_BATCH)]
    return out


tiny_turn = st.tuples(st.integers(1, 40000), st.floats(0.0, 30.0), st.integers(0, 3000))


@settings(max_examples=12, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 4000), st.lists(tiny_turn, min_size=1,
                                                                 max_size=3)),
                       min_size=1, max_size=3),
       gpus=st.sampled_from([1, 2, 4, 8]), model=st.sampled_from(["qwen3-8b", "qwen3-14b"]))
def test_bound_never_exceeds_any_pinned_schedule_of_a_tiny_batch(
        shapes: list[tuple[int, list[tuple[int, float, int]]]], gpus: int, model: str) -> None:
    """Brute force: every layout of the GPUs, every assignment of trajectories to its
    engines, all at once or one at a time in either order."""
    cost = _cost(model)
    trajs = []
    for i, (prompt, turns) in enumerate(shapes):
        ctx, kept = prompt, []
        for k, (out, lat, obs) in enumerate(turns):
            out = min(out, 40960 - ctx - 1)
            if out < 1:
                break
            last = k == len(turns) - 1 or ctx + out + obs >= 40960 - 1
            kept.append((out, 0.0, 0) if last else (out, lat, obs))
            ctx += out + (0 if last else obs)
            if last:
                break
        if kept:
            trajs.append(_traj(prompt, kept, f"t{i}"))
    if not trajs:
        return
    n = len(trajs)
    lb = lower_bound(trajs, cost, gpus)
    best = math.inf
    for layout in _layouts(gpus, [d for d in TP_DEGREES if d >= cost.min_tp()]):
        for engine_of, cap in _pinned_schedules(n, layout):
            for order in ([*range(n)], [*range(n)][::-1]) if cap == 1 else ([*range(n)],):
                sched = FakePinnedScheduler(engine_of, order, cap)
                result = Cluster(cost, gpus, sched, trajs, list(layout),
                                 max_batch=MAX_BATCH).run()
                assert result.makespan_s >= lb.makespan_s * (1 - 1e-9), (layout, engine_of)
                best = min(best, result.makespan_s)
    assert best >= lb.makespan_s * (1 - 1e-9)

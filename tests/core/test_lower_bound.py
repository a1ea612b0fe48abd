"""The makespan lower bound (`treadle.core.lower_bound`): the envelope integral
against numeric integration, the bound of hand-built trajectories against the cost
model, and — the contract that matters — the bound never exceeds what any policy
achieves in the simulator."""

from __future__ import annotations

import functools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.lower_bound import _envelope_integral, lower_bound
from treadle.core.policies import build_policy, parse_policy
from treadle.sim.cluster import Cluster
from treadle.sim.runner import MAX_BATCH, history_for, outcomes, simulate
from treadle.sim.workload import TrajectorySpec, TurnSpec, Workload, generate

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
    assert lb.makespan_s == max(lb.critical_path_s, lb.total_work_s)


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

# (workload, trajectories, GPUs, seed, warm): warm runs give the predictors the
# previous step's outcomes, so heddle and treadle plan mixed-TP pools from them.
CASES = [
    *((name, n, gpus, 0, False) for name in ("coding", "search", "math", "swe")
      for n, gpus in ((32, 8), (64, 16))),
    *((name, 32, 8, 1, True) for name in ("coding", "search", "math", "swe")),
    ("coding", 64, 16, 2, True), ("search", 64, 8, 3, False), ("math", 64, 8, 4, False),
    ("swe", 32, 16, 5, False),
]


@pytest.mark.parametrize(("name", "n", "gpus", "seed", "warm"), CASES)
def test_bound_never_exceeds_any_policys_simulated_makespan(name: str, n: int, gpus: int,
                                                           seed: int, warm: bool) -> None:
    cost = _cost()
    workload = generate(name, n, seed=seed, group_size=16)
    history = history_for(name, n, seed) if warm else []
    lb = lower_bound(workload.trajectories, cost, gpus)
    assert lb.critical_path_s > 0 and lb.total_work_s > 0
    for policy in POLICIES:
        report, result = simulate(workload, policy, cost, gpus, history=history, seed=seed,
                                  bound=lb)
        assert result.makespan_s >= lb.critical_path_s * (1 - 1e-9), policy
        assert result.makespan_s >= lb.total_work_s * (1 - 1e-9), policy
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

"""One simulated engine (`treadle.sim.engine.SimEngine`): closed-form progress
against a step-by-step reference, the prefix cache, engine-side KV eviction and
the admission headroom."""

from __future__ import annotations

import functools
import math
import random

import pytest

from treadle.core.cost_model import GPUS, MODELS, CostModel, GpuSpec
from treadle.sim.engine import ADMIT_HEADROOM, SimEngine

Job = tuple[float, str, int, int]  # (join time, traj id, context at join, tokens to generate)


@functools.cache
def _cost(model: str = "qwen3-14b") -> CostModel:
    return CostModel.named(model, "h100")


def tiny_cost(kv_tokens_at_tp1: int, model: str = "qwen3-8b") -> CostModel:
    """A cost model whose TP-1 engine holds about `kv_tokens_at_tp1` KV tokens: an
    H100 with just enough memory for the weights, the reserve and that cache."""
    m, h100 = MODELS[model], GPUS["h100"]
    probe = CostModel(m, h100)
    p = probe.params
    hbm = (m.weight_bytes + p.activation_reserve_bytes
           + (kv_tokens_at_tp1 + 0.5) * m.kv_bytes_per_token) / p.memory_utilization
    gpu = GpuSpec("tiny", hbm, h100.hbm_bw, h100.bf16_flops, h100.nvlink_bw, "test double")
    return CostModel(m, gpu)


# -- reference and closed form -------------------------------------------------------------


def closed_form(cost: CostModel, tp: int, jobs: list[Job]) -> tuple[dict[str, float], float]:
    """Drive a SimEngine the way the cluster does; returns finish times and busy time."""
    eng = SimEngine("e0", tp, cost, max_batch=1024)
    pending = sorted(jobs)
    finish: dict[str, float] = {}
    while pending or eng.running:
        nxt = eng.next_event()
        if pending and (nxt is None or pending[0][0] <= nxt[0]):
            t, tid, ctx, tokens = pending.pop(0)
            eng.advance(t)
            eng.join(tid, t, ctx, ctx, tokens, 0.0, 0.0)
            continue
        assert nxt is not None
        at, kind = nxt
        assert kind == "done"
        eng.advance(at)
        done = eng.finished(due=True)
        assert done
        for tid in done:
            context, generated = eng.leave(tid, keep_cache=False)
            job = next(j for j in jobs if j[1] == tid)
            assert generated == pytest.approx(job[3], abs=1e-6)
            assert context == pytest.approx(job[2] + job[3], abs=1e-6)
            finish[tid] = at
    return finish, eng.busy_s


def stepwise(cost: CostModel, tp: int, jobs: list[Job]) -> tuple[dict[str, float], float]:
    """Reference: integer decode steps. Arrivals join at the next step boundary and
    their prefill stalls the batch; each step costs step_time(tp, n, Σ context) and
    adds one token to every running sequence."""
    pending = sorted(jobs)
    running: dict[str, list[int]] = {}  # id -> [context, tokens left]
    finish: dict[str, float] = {}
    now, busy = 0.0, 0.0
    while pending or running:
        if not running and pending[0][0] > now:
            now = pending[0][0]  # idle until the next arrival
        while pending and pending[0][0] <= now:
            _, tid, ctx, tokens = pending.pop(0)
            stall = cost.prefill_time(tp, ctx)
            now += stall
            busy += stall
            running[tid] = [ctx, tokens]
        step = cost.step_time(tp, len(running), sum(c for c, _ in running.values()))
        now += step
        busy += step
        for tid in list(running):
            running[tid][0] += 1
            running[tid][1] -= 1
            if running[tid][1] == 0:
                del running[tid]
                finish[tid] = now
    return finish, busy


def random_jobs(seed: int, n: int = 8) -> list[Job]:
    rng = random.Random(seed)
    return [(round(rng.uniform(0.0, 6.0), 3) if i else 0.0, f"s{i}", rng.randint(200, 8000),
             rng.randint(100, 1500)) for i in range(n)]


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("seed", range(5))
def test_closed_form_progress_matches_a_step_by_step_reference(seed: int, tp: int) -> None:
    cost = _cost()
    jobs = random_jobs(seed)
    fast, fast_busy = closed_form(cost, tp, jobs)
    slow, slow_busy = stepwise(cost, tp, jobs)
    makespan = max(slow.values())
    assert set(fast) == set(slow) == {j[1] for j in jobs}
    for tid, t in slow.items():
        assert abs(fast[tid] - t) <= 0.005 * makespan, tid
    assert max(fast.values()) == pytest.approx(makespan, rel=0.005)
    assert fast_busy == pytest.approx(slow_busy, rel=0.005)


def test_closed_form_with_an_idle_gap_and_a_late_joiner() -> None:
    cost = _cost()
    jobs: list[Job] = [(0.0, "a", 1000, 400), (30.0, "b", 500, 800), (30.5, "c", 4000, 50)]
    fast, busy = closed_form(cost, 2, jobs)
    slow, slow_busy = stepwise(cost, 2, jobs)
    assert fast["a"] < 30.0  # a finished alone before b arrived: the engine idled
    for tid in slow:
        assert fast[tid] == pytest.approx(slow[tid], rel=0.005)
    assert busy == pytest.approx(slow_busy, rel=0.005)
    assert busy < max(fast.values()) - 20.0  # the idle gap is not busy time


def test_single_sequence_is_exactly_prefill_plus_decode() -> None:
    cost = _cost()
    eng = SimEngine("e0", 2, cost, max_batch=8)
    prefill = eng.join("a", 0.0, 3000, 3000, 2500, 0.0, 0.0)
    assert prefill == pytest.approx(cost.prefill_time(2, 3000))
    nxt = eng.next_event()
    assert nxt is not None
    at, kind = nxt
    assert kind == "done"
    assert at == pytest.approx(prefill + cost.decode_time(2, 1, 3000, 2500), rel=1e-12)
    # Halfway in time, it is not done; progress is monotone.
    eng.advance(at / 2)
    assert 0 < eng.steps < 2500
    assert eng.finished(due=False) == []
    eng.advance(at)
    assert eng.finished(due=True) == ["a"]


def test_leave_reports_context_and_tokens_of_a_partly_generated_turn() -> None:
    cost = _cost()
    eng = SimEngine("e0", 1, cost, max_batch=8)
    eng.join("a", 0.0, 1000, 1000, 600, 150.0, 0.0)  # 150 tokens of this turn done before
    prefill = eng.stall_until
    eng.advance(prefill + cost.decode_time(1, 1, 1000, 200))
    context, generated = eng.leave("a", keep_cache=False)
    assert context == pytest.approx(1200, abs=1e-6)
    assert generated == pytest.approx(350, abs=1e-6)
    assert eng.kv_used() == pytest.approx(0.0, abs=1e-9)
    assert eng.next_event() is None


# -- prefix cache --------------------------------------------------------------------------------


def _run_one_turn(eng: SimEngine, tid: str, now: float, context: int, new: int,
                  tokens: int, keep_cache: bool) -> float:
    eng.advance(now)
    eng.join(tid, now, context, new, tokens, 0.0, 0.0)
    nxt = eng.next_event()
    assert nxt is not None and nxt[1] == "done"
    eng.advance(nxt[0])
    assert eng.finished(due=True) == [tid]
    eng.leave(tid, keep_cache=keep_cache)
    return nxt[0]


def test_rejoin_after_leave_with_cache_prefills_only_the_new_tokens() -> None:
    cost = _cost()
    eng = SimEngine("e0", 1, cost, max_batch=8)
    end = _run_one_turn(eng, "a", 0.0, 1000, 1000, 500, keep_cache=True)
    assert eng.cache["a"] == pytest.approx(1500)
    back = end + 2.0  # the tool call took 2 s and appended 200 tokens
    eng.advance(back)
    prefill = eng.join("a", back, 1700, 200, 300, 0.0, 0.0)
    assert prefill == pytest.approx(cost.prefill_time(1, 200, 1500), rel=1e-12)
    assert eng.stall_until == pytest.approx(back + prefill, rel=1e-12)
    assert prefill < 0.5 * cost.prefill_time(1, 1700)
    assert "a" not in eng.cache and eng.cache_tokens == 0.0


def test_rejoin_without_cache_prefills_the_whole_context() -> None:
    cost = _cost()
    eng = SimEngine("e0", 1, cost, max_batch=8)
    end = _run_one_turn(eng, "a", 0.0, 1000, 1000, 500, keep_cache=False)
    assert "a" not in eng.cache
    eng.advance(end + 2.0)
    prefill = eng.join("a", end + 2.0, 1700, 200, 300, 0.0, 0.0)
    assert prefill == pytest.approx(cost.prefill_time(1, 1700), rel=1e-12)


def test_cached_prefix_never_covers_the_new_tokens() -> None:
    cost = _cost()
    eng = SimEngine("e0", 1, cost, max_batch=8)
    eng.put_cached("a", 5000.0)  # more than the context before the new tokens
    prefill = eng.join("a", 0.0, 1700, 200, 300, 0.0, 0.0)
    assert prefill == pytest.approx(cost.prefill_time(1, 200, 1500), rel=1e-12)


def test_another_trajectorys_cache_is_no_use() -> None:
    cost = _cost()
    eng = SimEngine("e0", 1, cost, max_batch=8)
    eng.put_cached("other", 1500.0)
    prefill = eng.join("a", 0.0, 1700, 200, 300, 0.0, 0.0)
    assert prefill == pytest.approx(cost.prefill_time(1, 1700), rel=1e-12)
    assert eng.cache["other"] == 1500.0


def test_prefix_cache_is_lru_and_yields_to_running_sequences() -> None:
    cost = tiny_cost(5000)
    eng = SimEngine("e0", 1, cost, max_batch=8)
    assert 4990 <= eng.kv_capacity <= 5010
    for tid in ("x", "y", "z"):
        eng.put_cached(tid, 2000.0)
    assert list(eng.cache) == ["y", "z"]  # x, least recently used, made room
    assert eng.cache_tokens == pytest.approx(4000.0)
    eng.put_cached("y", 2000.0)  # touch y: z is now the oldest
    eng.join("a", 0.0, 2500, 2500, 100, 0.0, 0.0)  # running KV pushes the cache out
    assert list(eng.cache) == ["y"]
    assert eng.cache_tokens + eng.kv_used() <= eng.kv_capacity


# -- KV exhaustion ---------------------------------------------------------------------------------


def test_kv_full_fires_when_the_batch_outgrows_the_cache_and_evicts_the_latest() -> None:
    cost = tiny_cost(4000)
    eng = SimEngine("e0", 1, cost, max_batch=8)
    cap = eng.kv_capacity
    for tid in ("a", "b", "c"):
        assert eng.fits(1000)
        eng.join(tid, 0.0, 1000, 1000, 5000, 0.0, 0.0)
    nxt = eng.next_event()
    assert nxt is not None
    at, kind = nxt
    assert kind == "kv_full"
    alpha, beta = cost.step_coeffs(1, 3)
    steps = (cap - 3000) / 3
    expected = eng.stall_until + steps * (alpha + beta * 3000) + beta * 3 * steps**2 / 2
    assert at == pytest.approx(expected, rel=1e-9)
    eng.advance(at)
    assert eng.kv_used() == pytest.approx(cap, rel=1e-9)
    assert eng.evict_victim() == "c"  # equal priorities: the latest to join goes
    context, generated = eng.leave("c", keep_cache=False)
    assert generated == pytest.approx(steps, rel=1e-9)
    assert context == pytest.approx(1000 + steps, rel=1e-9)
    nxt2 = eng.next_event()
    assert nxt2 is not None and nxt2[1] == "kv_full" and nxt2[0] > at


def test_eviction_victim_is_the_lowest_priority_then_the_latest() -> None:
    eng = SimEngine("e0", 1, _cost(), max_batch=8)
    eng.join("a", 0.0, 100, 100, 50, 0.0, 9.0)  # least important (highest value), earliest
    eng.join("b", 0.0, 100, 100, 50, 0.0, 1.0)
    eng.join("c", 0.0, 100, 100, 50, 0.0, 1.0)
    assert eng.evict_victim() == "a"
    eng.leave("a", keep_cache=False)
    assert eng.evict_victim() == "c"


def test_a_single_sequence_is_never_reported_kv_full() -> None:
    cost = tiny_cost(3000)
    eng = SimEngine("e0", 1, cost, max_batch=8)
    eng.join("a", 0.0, 2000, 2000, 5000, 0.0, 0.0)  # will outgrow the cache alone
    nxt = eng.next_event()
    assert nxt is not None and nxt[1] == "done"


def test_done_comes_before_kv_full_when_it_is_sooner() -> None:
    cost = tiny_cost(4000)
    eng = SimEngine("e0", 1, cost, max_batch=8)
    eng.join("a", 0.0, 1000, 1000, 10, 0.0, 0.0)
    eng.join("b", 0.0, 1000, 1000, 5000, 0.0, 0.0)
    nxt = eng.next_event()
    assert nxt is not None and nxt[1] == "done"


# -- admission ---------------------------------------------------------------------------------


def test_fits_honours_the_admit_headroom() -> None:
    cost = tiny_cost(10_000)
    eng = SimEngine("e0", 1, cost, max_batch=8)
    limit = eng.kv_capacity * (1.0 - ADMIT_HEADROOM)
    assert eng.fits(math.floor(limit))
    assert not eng.fits(math.floor(limit) + 1)
    assert not eng.fits(eng.kv_capacity)  # the whole cache is not enough: headroom
    eng.join("a", 0.0, 4000, 4000, 100, 0.0, 0.0)
    assert eng.fits(math.floor(limit) - 4000)
    assert not eng.fits(math.floor(limit) - 4000 + 1)


def test_fits_honours_max_batch() -> None:
    eng = SimEngine("e0", 1, _cost(), max_batch=2)
    eng.join("a", 0.0, 10, 10, 100, 0.0, 0.0)
    assert eng.fits(10)
    eng.join("b", 0.0, 10, 10, 100, 0.0, 0.0)
    assert not eng.fits(1)
    eng.leave("a", keep_cache=False)
    assert eng.fits(1)


def test_zero_capacity_engine_fits_nothing() -> None:
    cost = tiny_cost(0)
    eng = SimEngine("e0", 1, cost, max_batch=8)
    assert eng.kv_capacity == 0
    assert not eng.fits(1)

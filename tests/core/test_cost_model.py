"""The engine cost model (`treadle.core.cost_model`): table lookups, the shape of
decode step time, the closed-form series the simulator jumps with, capacity,
migration and prefill."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.core.cost_model import (
    GPUS,
    MODELS,
    TP_DEGREES,
    CostModel,
    CostParams,
    series_steps,
    series_time,
)

MODEL_GPU = list(itertools.product(sorted(MODELS), sorted(GPUS)))


def _cost(model: str = "qwen3-14b", gpu: str = "h100") -> CostModel:
    return CostModel.named(model, gpu)


# -- tables --------------------------------------------------------------------------


def test_named_looks_up_both_tables() -> None:
    cost = CostModel.named("qwen3-32b", "h200")
    assert cost.model is MODELS["qwen3-32b"]
    assert cost.gpu is GPUS["h200"]
    assert cost.params == CostParams()


def test_named_uses_given_params() -> None:
    params = CostParams(hbm_efficiency=0.5)
    assert CostModel.named("qwen3-8b", "h100", params).params is params


def test_unknown_model_keyerror_names_every_valid_model() -> None:
    with pytest.raises(KeyError) as info:
        CostModel.named("llama-70b", "h100")
    message = info.value.args[0]
    assert "llama-70b" in message
    for name in MODELS:
        assert name in message


def test_unknown_gpu_keyerror_names_every_valid_gpu() -> None:
    with pytest.raises(KeyError) as info:
        CostModel.named("qwen3-14b", "a100")
    message = info.value.args[0]
    assert "a100" in message
    for name in GPUS:
        assert name in message


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_table_is_consistent(name: str) -> None:
    m = MODELS[name]
    assert m.name == name
    assert m.weight_bytes == pytest.approx(2.0 * m.params)
    assert m.kv_bytes_per_token == m.layers * m.kv_heads * m.head_dim * 4
    assert m.source


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_table_is_consistent(name: str) -> None:
    g = GPUS[name]
    assert g.name == name
    assert g.hbm_bytes > 0 and g.hbm_bw > 0 and g.bf16_flops > 0 and g.nvlink_bw > 0
    assert g.source


# -- decode step ---------------------------------------------------------------------


@pytest.mark.parametrize(("model", "gpu"), MODEL_GPU)
def test_step_time_is_linear_in_kv(model: str, gpu: str) -> None:
    cost = _cost(model, gpu)
    for tp, batch in itertools.product(TP_DEGREES, (1, 3, 64, 1024)):
        alpha, beta = cost.step_coeffs(tp, batch)
        assert alpha > 0 and beta > 0
        for kv in (0.0, 1.0, 4096.0, 123_457.0, 2e6):
            assert cost.step_time(tp, batch, kv) == pytest.approx(alpha + beta * kv, rel=1e-12)
        # Affine: the midpoint of two KV sizes costs the mean of their times.
        lo, hi = cost.step_time(tp, batch, 1000.0), cost.step_time(tp, batch, 90_000.0)
        assert cost.step_time(tp, batch, 45_500.0) == pytest.approx((lo + hi) / 2, rel=1e-12)


@pytest.mark.parametrize(("model", "gpu"), MODEL_GPU)
def test_step_parts_add_up_to_alpha(model: str, gpu: str) -> None:
    cost = _cost(model, gpu)
    for tp in TP_DEGREES:
        parts = cost.step_parts(tp)
        assert parts.tp == tp and parts.kv_s == cost.step_coeffs(tp, 1)[1]
        for batch in (1, 2, 7, 100, 333, 1024, 5000):
            assert parts.alpha(batch) == pytest.approx(cost.step_coeffs(tp, batch)[0], rel=1e-12)


def test_step_coeffs_are_cached_and_stable() -> None:
    cost = _cost()
    first = cost.step_coeffs(2, 17)
    assert cost.step_coeffs(2, 17) == first
    assert cost.step_coeffs(2, 18) != first


@pytest.mark.parametrize(("model", "gpu"), MODEL_GPU)
def test_step_time_falls_with_tp_at_batch_one(model: str, gpu: str) -> None:
    cost = _cost(model, gpu)
    for kv in (0.0, 1000.0, 40960.0):
        times = [cost.step_time(tp, 1, kv) for tp in TP_DEGREES]
        assert times == sorted(times, reverse=True)
        assert len(set(times)) == len(times)  # strictly


@pytest.mark.parametrize(("model", "gpu"), MODEL_GPU)
def test_step_time_grows_with_batch_and_kv(model: str, gpu: str) -> None:
    cost = _cost(model, gpu)
    for tp in TP_DEGREES:
        by_batch = [cost.step_time(tp, b, 10_000.0) for b in (1, 2, 8, 64, 256, 1024)]
        assert all(a < b for a, b in itertools.pairwise(by_batch))
        by_kv = [cost.step_time(tp, 8, kv) for kv in (0.0, 1.0, 1e3, 1e5, 1e6)]
        assert all(a < b for a, b in itertools.pairwise(by_kv))


def test_min_step_time_is_the_best_degree_at_batch_one() -> None:
    cost = _cost()
    for ctx in (0.0, 500.0, 30_000.0):
        assert cost.min_step_time(ctx) == min(cost.step_time(tp, 1, ctx) for tp in TP_DEGREES)
        assert cost.min_step_time(ctx) <= cost.step_time(8, 1, ctx)


def test_allreduce_is_free_at_tp1_and_grows_with_ranks_and_tokens() -> None:
    cost = _cost()
    assert cost.allreduce_s(1) == 0.0
    assert cost.allreduce_s(1, 4096.0) == 0.0
    assert cost.allreduce_s(2) < cost.allreduce_s(4) < cost.allreduce_s(8)
    assert cost.allreduce_s(4, 1.0) < cost.allreduce_s(4, 1024.0)


# -- closed-form series ----------------------------------------------------------------

_FIRST = st.floats(min_value=1e-4, max_value=1.0, allow_nan=False, allow_infinity=False)
_GROWTH = st.one_of(
    st.just(0.0),
    st.floats(min_value=1e-12, max_value=1e-3, allow_nan=False, allow_infinity=False),
)
_STEPS = st.floats(min_value=0.0, max_value=1e5, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(first=_FIRST, growth=_GROWTH, steps=_STEPS)
def test_series_steps_inverts_series_time(first: float, growth: float, steps: float) -> None:
    duration = series_time(first, growth, steps)
    assert duration >= 0.0
    back = series_steps(first, growth, duration)
    assert back == pytest.approx(steps, rel=1e-9, abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(first=_FIRST, growth=_GROWTH,
       duration=st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False))
def test_series_time_inverts_series_steps(first: float, growth: float, duration: float) -> None:
    steps = series_steps(first, growth, duration)
    assert steps >= 0.0
    assert series_time(first, growth, steps) == pytest.approx(duration, rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(first=_FIRST, growth=_GROWTH, a=_STEPS, b=_STEPS)
def test_series_time_is_monotone_in_steps(first: float, growth: float, a: float,
                                          b: float) -> None:
    lo, hi = sorted((a, b))
    assert series_time(first, growth, lo) <= series_time(first, growth, hi)


def test_series_edge_cases() -> None:
    assert series_time(0.01, 1e-6, 0.0) == 0.0
    assert series_steps(0.01, 1e-6, 0.0) == 0.0
    assert series_steps(0.01, 1e-6, -5.0) == 0.0
    assert series_steps(0.01, 0.0, 1.0) == pytest.approx(100.0)
    # a·n + g·n²/2 by hand
    assert series_time(0.5, 0.1, 10.0) == pytest.approx(0.5 * 10 + 0.1 * 100 / 2)


@pytest.mark.parametrize(("tp", "batch", "context", "tokens"),
                         [(1, 1, 500, 2000), (2, 7, 30_000, 800), (8, 64, 200_000, 3000),
                          (4, 1, 0, 1)])
def test_decode_time_matches_a_brute_force_sum_of_steps(tp: int, batch: int, context: int,
                                                        tokens: int) -> None:
    cost = _cost()
    brute = math.fsum(cost.step_time(tp, batch, context + batch * k) for k in range(tokens))
    closed = cost.decode_time(tp, batch, context, tokens)
    last_step = cost.step_time(tp, batch, context + batch * tokens)
    assert abs(closed - brute) <= last_step
    # The continuous form overstates by exactly half a step's growth per step.
    _, beta = cost.step_coeffs(tp, batch)
    assert closed - brute == pytest.approx(beta * batch * tokens / 2.0, rel=1e-6, abs=1e-12)


# -- capacity, migration, prefill, restart ---------------------------------------------


def test_qwen3_32b_does_not_fit_a_full_context_on_one_h100() -> None:
    cost = _cost("qwen3-32b", "h100")
    assert cost.kv_capacity_tokens(1) < cost.model.max_context
    assert cost.kv_capacity_tokens(2) >= cost.model.max_context
    assert cost.min_tp() == 2


def test_qwen3_14b_fits_on_one_h100() -> None:
    cost = _cost("qwen3-14b", "h100")
    assert cost.kv_capacity_tokens(1) >= cost.model.max_context
    assert cost.min_tp() == 1


@pytest.mark.parametrize(("model", "gpu"), MODEL_GPU)
def test_kv_capacity_grows_with_tp(model: str, gpu: str) -> None:
    cost = _cost(model, gpu)
    caps = [cost.kv_capacity_tokens(tp) for tp in TP_DEGREES]
    assert all(a < b for a, b in itertools.pairwise(caps))
    assert all(isinstance(c, int) and c >= 0 for c in caps)


def test_kv_capacity_is_zero_when_weights_do_not_fit() -> None:
    params = CostParams(memory_utilization=0.3)
    cost = CostModel.named("qwen3-32b", "h100", params)
    assert cost.kv_capacity_tokens(1) == 0
    assert cost.kv_capacity_tokens(8) > 0


def test_min_tp_raises_when_nothing_fits() -> None:
    cost = CostModel.named("qwen3-32b", "h100", CostParams(memory_utilization=0.05))
    with pytest.raises(ValueError, match="does not fit"):
        cost.min_tp()


def test_migration_time_grows_with_context() -> None:
    cost = _cost()
    assert cost.migration_time(0.0) == pytest.approx(cost.params.migration_setup_s)
    times = [cost.migration_time(c) for c in (0.0, 1.0, 1000.0, 40960.0, 1e6)]
    assert all(a < b for a, b in itertools.pairwise(times))
    # Linear: KV bytes over the link.
    slope = cost.model.kv_bytes_per_token / cost.params.kv_link_bw
    assert cost.migration_time(2000.0) - cost.migration_time(1000.0) == pytest.approx(
        1000.0 * slope)


@pytest.mark.parametrize("tp", TP_DEGREES)
def test_prefill_of_nothing_is_free(tp: int) -> None:
    cost = _cost()
    assert cost.prefill_time(tp, 0) == 0.0
    assert cost.prefill_time(tp, 0, 50_000.0) == 0.0
    assert cost.prefill_time(tp, -3, 10.0) == 0.0


def test_prefill_grows_with_new_and_cached_tokens() -> None:
    cost = _cost()
    for tp in TP_DEGREES:
        assert 0.0 < cost.prefill_time(tp, 1) < cost.prefill_time(tp, 1000)
        assert cost.prefill_time(tp, 1000) < cost.prefill_time(tp, 1000, 30_000.0)
    # Compute-bound: more GPUs prefill a long prompt faster.
    long = [cost.prefill_time(tp, 16_000) for tp in TP_DEGREES]
    assert long == sorted(long, reverse=True)


def test_restart_time_has_a_fixed_part_and_faster_loads_with_tp() -> None:
    cost = _cost()
    times = [cost.restart_time(tp) for tp in TP_DEGREES]
    assert all(t > cost.params.restart_base_s for t in times)
    assert times == sorted(times, reverse=True)

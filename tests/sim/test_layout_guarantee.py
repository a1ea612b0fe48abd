"""treadle's layout against every homogeneous pool, measured: on workloads of shapes
nothing was tuned on (`workloads.shapes`) and two seeds each, treadle's step is never
slower than the best homogeneous baseline's (slime and verl at TP 1, 2, 4 and 8)
beyond the ±1% that scheduling on one and the same pool differs by. By construction
(`tests/core/test_layout.py`) its pool is never one its scorer rates below a
homogeneous pool; this checks that the rating carries over to the true batch."""

from __future__ import annotations

import functools

import pytest

from treadle.core.cost_model import CostModel
from treadle.sim.runner import history_for, simulate
from treadle.workloads.load import generate_named
from treadle.workloads.shapes import SHAPES

N, GPUS = 256, 16
NOISE = 0.01  # treadle and verl on one pool differ by up to ±0.5% (scheduling, not layout)
HOMOGENEOUS = [f"{p}@tp{tp}" for p in ("slime", "verl") for tp in (1, 2, 4, 8)]


@functools.cache
def _cost() -> CostModel:
    return CostModel.named("qwen3-14b", "h100")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
def test_treadle_is_never_slower_than_the_best_homogeneous_pool(shape: str, seed: int) -> None:
    workload = generate_named(shape, N, seed=seed)
    history = history_for(shape, N, seed)
    ours, _ = simulate(workload, "treadle", _cost(), GPUS, history=history)
    best = min((simulate(workload, p, _cost(), GPUS, history=history)[0] for p in HOMOGENEOUS),
               key=lambda r: r.makespan_s)
    assert ours.makespan_s <= best.makespan_s * (1.0 + NOISE), (
        f"treadle {ours.makespan_s:.1f} s on {ours.layout}, {best.policy} {best.makespan_s:.1f} s")

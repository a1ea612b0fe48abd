"""The three ways of judging carried out live (`treadle.bench.judge_live`): a small
coding workload replayed on emulated engine processes, every trajectory judged once."""

from __future__ import annotations

import asyncio

import pytest

from treadle.bench.judge_live import LiveJudged, live_judged
from treadle.core.cost_model import CostModel
from treadle.core.policies import parse_policy
from treadle.sim.judging import JudgeSizes, parse_judge
from treadle.workloads.load import generate_named

pytestmark = pytest.mark.integration
N, GPUS = 16, 4


def _run(mode: str | None, alone_s: float | None = None) -> LiveJudged:
    cost = CostModel.named("qwen3-14b", "h100")
    workload = generate_named("coding", N, seed=0, max_context=cost.model.max_context)
    return asyncio.run(live_judged(
        workload, parse_policy("verl"), cost, GPUS, None if mode is None else parse_judge(mode),
        sizes=JudgeSizes(), time_scale=0.03, seed=0, model="qwen3-14b", gpu="h100",
        rollout_alone_s=alone_s))


def test_each_mode_judges_every_trajectory_where_and_when_it_says() -> None:
    alone = _run(None)
    assert (alone.judge, alone.errors, alone.first_verdict_s) == ("none", 0, 0.0)
    assert alone.judged_makespan_s == alone.rollout_makespan_s and alone.overhead == 0.0
    rows = {m: _run(m, alone.rollout_makespan_s) for m in ("shared", "after", "dedicated:2")}
    for mode, row in rows.items():
        assert row.errors == 0, mode
        assert row.judged_makespan_s >= row.rollout_makespan_s, mode
        assert row.overhead == pytest.approx(
            row.judged_makespan_s / alone.rollout_makespan_s - 1.0), mode
    # After: no verdict before the last rollout finished; shared and dedicated judge
    # a trajectory as it finishes, so their first verdicts come while others still run.
    assert rows["after"].first_verdict_s >= rows["after"].rollout_makespan_s
    assert rows["shared"].first_verdict_s < rows["shared"].rollout_makespan_s
    assert rows["dedicated:2"].first_verdict_s < rows["dedicated:2"].rollout_makespan_s
    # One pool for shared and after; a dedicated pool of 2 GPUs beside 2 for rollouts.
    assert rows["shared"].judge_layout == rows["shared"].layout == alone.layout == "tp1x4"
    assert (rows["dedicated:2"].layout, rows["dedicated:2"].judge_layout) == ("tp1x2", "tp1x2")


def test_a_judged_run_needs_the_rollout_phase_alone() -> None:
    with pytest.raises(ValueError, match="rollout phase alone"):
        _run("shared")

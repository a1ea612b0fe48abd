"""The robustness shapes (`treadle.workloads.shapes`): seeded, documented, capped,
and run by the scheduling benchmark (`treadle.bench.sim`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

import pytest

from treadle.bench.sim import markdown_report, run_bench, workload_and_history
from treadle.cli import main
from treadle.service.planning import _replay_specs
from treadle.service.schemas import ReplayTasks
from treadle.sim.runner import history_for, outcomes
from treadle.workloads.load import GENERATED, generate_named, load_workload
from treadle.workloads.shapes import SHAPES, generate_shape
from treadle.workloads.synthetic import WORKLOADS, generate


@pytest.mark.parametrize("name", SHAPES)
def test_same_seed_same_workload_and_another_seed_another(name: str) -> None:
    assert generate_shape(name, 64, seed=3) == generate_shape(name, 64, seed=3)
    assert generate_shape(name, 64, seed=3) != generate_shape(name, 64, seed=4)


@pytest.mark.parametrize("name", SHAPES)
def test_a_larger_batch_extends_the_smaller_one(name: str) -> None:
    small, large = generate_shape(name, 32), generate_shape(name, 64)
    assert large.trajectories[:32] == small.trajectories


@pytest.mark.parametrize("name", SHAPES)
def test_contexts_respect_the_cap_and_ids_are_unique(name: str) -> None:
    w = generate_shape(name, 256, max_context=8192)
    assert all(t.context_tokens <= 8192 for t in w.trajectories)
    assert len({t.traj_id for t in w.trajectories}) == 256
    assert all(t.traj_id.startswith(f"{name}-s0-g") for t in w.trajectories)


def test_the_shapes_are_the_documented_ones() -> None:
    """p99/p50 of output tokens at 1,024, seed 0: heavy tails for pareto and
    bimodal, none for flat; short is short."""
    def tail(name: str) -> tuple[float, float]:
        o = generate_shape(name, 1024).stats().output_tokens
        return o.p50, o.p99 / o.p50

    assert tail("pareto")[1] > 10 and tail("bimodal")[1] > 10
    assert tail("flat")[1] < 1.2 and 6_000 <= tail("flat")[0] <= 8_000
    assert tail("short")[0] < 500


def test_unknown_shape_and_bad_counts_raise() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        generate_shape("lognormal")
    with pytest.raises(ValueError, match="multiple"):
        generate_shape("flat", 17)
    with pytest.raises(ValueError, match="unknown workload"):
        workload_and_history("nope", 16, 0, 40960)


def test_history_is_the_next_seed_of_the_same_generator() -> None:
    workload, history = workload_and_history("pareto", 32, 5, 40960)
    assert workload == generate_shape("pareto", 32, seed=5)
    assert len(history) == 32
    assert {o.group_id for o in history} == {f"pareto-s6-g{g:04d}" for g in range(2)}


@pytest.mark.parametrize("name", GENERATED)
def test_every_generated_name_loads_from_its_own_generator(name: str) -> None:
    own = generate_shape if name in SHAPES else generate
    assert generate_named(name, 32, seed=2, group_size=8) == own(name, 32, seed=2, group_size=8)
    assert load_workload(name, 32, 2, 40960) == own(name, 32, seed=2)
    assert history_for(name, 32, 2) == outcomes(own(name, 32, seed=3))
    assert set(WORKLOADS) | set(SHAPES) == set(GENERATED)


def test_the_service_replays_every_generated_name() -> None:
    """The job schema's names are `GENERATED`'s, and a shape plans its own trajectories."""
    assert get_args(get_args(ReplayTasks.model_fields["workload"].annotation)[0]) == GENERATED
    specs = _replay_specs(ReplayTasks(workload="bimodal", trajectories=32, seed=1), 40960)
    assert specs == list(generate_shape("bimodal", 32, seed=1).trajectories)


def test_treadle_sim_runs_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--workload", "pareto", "--trajectories", "32", "--gpus", "8",
               "--policies", "verl,treadle", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert '"workload": "pareto"' in out and '"trajectories": 32' in out


@pytest.mark.slow  # the placement timing runs 4,096 trajectories
def test_bench_sim_runs_the_shapes_at_the_smallest_size(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    args = argparse.Namespace(sizes="16", workloads="math", seed=0, out=str(out),
                              shapes="flat,short")
    report = run_bench(args, log=lambda _: None)
    assert [r["workload"] for r in report["runs"]] == ["math"]
    assert [(r["workload"], r["trajectories"]) for r in report["shapes"]] == [
        ("flat", 16), ("short", 16)]
    assert "## Robustness" in markdown_report(report)

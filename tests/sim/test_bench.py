"""The scheduling benchmark (`treadle.bench.sim`) on a tiny configuration: the
report carries the lower bound's terms, every row is judged against that bound,
and the markdown shows them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from treadle.bench.sim import OURS, PAPER, TUNED, run_bench


@pytest.mark.slow  # the placement timing runs 4,096 trajectories
def test_a_tiny_bench_reports_the_bound_and_its_terms(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    args = argparse.Namespace(sizes="16", workloads="math", seed=0, out=str(out))
    report = run_bench(args, log=lambda _: None)
    assert json.loads(out.read_text()) == report
    (run,) = report["runs"]
    bound = run["lower_bound"]
    terms = (bound["critical_path_s"], bound["total_work_s"], bound["colocation_s"])
    assert bound["makespan_s"] == max(terms) > 0
    assert [r["policy"] for r in run["results"]] == [*PAPER, *TUNED, *OURS]
    for r in run["results"]:
        assert r["lower_bound_s"] == bound["makespan_s"]
        assert r["makespan_s"] >= bound["makespan_s"] * (1 - 1e-9), r["policy"]
    markdown = out.with_suffix(".md").read_text()
    assert "## Lower bound" in markdown
    assert f"| math | 16 | {bound['critical_path_s']:.1f} |" in markdown

"""`treadle bench service` end to end on a tiny configuration: the report has what
benchmarks/README.md reads from it (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.bench.service import Latencies, run_service_bench
from treadle.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_tiny_run_reports_every_job_and_the_service_apart_from_its_engines() -> None:
    report = run_service_bench(trajectories=16, jobs=2, workload="search", policy="verl",
                               engines=2, time_scale=0.02, model="qwen3-14b", gpu="h100",
                               seed=0, status_interval_s=0.05, log=lambda _m: None)
    assert report["setup"]["engine_processes"] == 2  # verl: one TP-1 engine per GPU
    jobs = report["jobs"]
    assert [j["delivered"] for j in jobs] == [16, 16]
    assert all(j["statuses"] == {"completed": 16} for j in jobs)
    for job in jobs:
        assert job["status_route"]["n"] > 0 and job["status_route"]["failures"] == 0
        assert job["submit_route"]["failures"] == 0 and job["cancel_route"]["failures"] == 0
        assert job["service_cpu_s"] > 0 and job["engines_cpu_s"] > 0
        assert job["sim_makespan_s"] > 0 and job["turns"] > 16
    assert jobs[0]["stream_full"]["n"] == 0  # nothing finished to re-read during the first
    assert report["idle_stream_reread"]["full"]["n"] == 5
    summary = report["summary"]
    assert len(summary["service_rss_mb_after_each_job"]) == 2
    assert summary["service_peak_rss_mb"] >= max(summary["service_rss_mb_after_each_job"])


def test_two_engine_http_stacks_run_side_by_side_as_arms() -> None:
    report = run_service_bench(trajectories=16, jobs=1, workload="search", policy="verl",
                               engines=1, time_scale=0.02, model="qwen3-14b", gpu="h100",
                               seed=0, status_interval_s=0.05, log=lambda _m: None,
                               engine_http=("httpx", "wire"))
    assert report["setup"]["engine_http"] == ["httpx", "wire"]
    assert set(report["arms"]) == {"httpx", "wire"}
    for name, arm in report["arms"].items():
        (job,) = arm["jobs"]
        assert job["engine_http"] == name and job["statuses"] == {"completed": 16}
        assert arm["summary"]["service_cpu_ms_per_turn_median"] > 0


def test_latencies_summarise_to_percentiles_in_milliseconds() -> None:
    lat = Latencies([0.001 * i for i in range(1, 101)], failures=2)
    assert lat.summary() == {"n": 100, "failures": 2, "p50_ms": 51.0, "p99_ms": 100.0,
                             "max_ms": 100.0}
    assert Latencies().summary() == {"n": 0, "failures": 0}


@pytest.mark.parametrize("args", [["--trajectories", "20"], ["--workload", "chess"],
                                  ["--time-scale", "0"], ["--jobs", "0"],
                                  ["--engine-http", "aiohttp"], ["--runners", "1,x"],
                                  ["--runners", "-1"]])
def test_bad_arguments_exit_2_with_one_line(args: list[str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "service", *args, "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treadle bench service: ") and "\n" not in err
    assert not (tmp_path / "r.json").exists()

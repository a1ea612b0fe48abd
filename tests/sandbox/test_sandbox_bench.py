"""`treadle bench sandbox`: the report's shape and bounds (never its speed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from sandbox_helpers import require_bwrap

from treadle.bench.sandbox import add_bench_parser, percentile, run_sandbox_bench


def check_backend_report(entry: dict[str, Any], samples: int, concurrency: int) -> None:
    assert "error" not in entry, entry
    cold = entry["cold_call"]
    assert cold["samples"] == samples and cold["errors"] == 0
    assert 0 < cold["p50_ms"] <= cold["p99_ms"]
    for phase in ("pooled", "fresh"):
        result = entry[phase]
        assert result["concurrency"] == concurrency and result["errors"] == 0, result
        assert result["calls"] > 0 and result["calls_per_s"] > 0
        assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert entry["pooled"]["pool_setup_s"] is not None and entry["fresh"]["pool_setup_s"] is None


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100 and percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0


def test_bench_command_writes_the_report(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="treadle")
    bench = parser.add_subparsers(dest="command").add_parser("bench")
    add_bench_parser(bench.add_subparsers(dest="bench"))
    out = tmp_path / "nested" / "sandbox.json"
    args = parser.parse_args(["bench", "sandbox", "--json", "--backends", "local", "--samples",
                              "3", "--concurrency", "4", "--duration", "0.3", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["benchmark"] == "sandbox" and list(report["backends"]) == ["local"]
    assert report["machine"]["cpus"] >= 1 and report["config"]["concurrency"] == 4
    check_backend_report(report["backends"]["local"], samples=3, concurrency=4)


@pytest.mark.parametrize("backends, samples, concurrency, duration", [
    (["docker"], 1, 1, 1.0), ([], 1, 1, 1.0), (["local"], 0, 1, 1.0), (["local"], 1, 0, 1.0),
    (["local"], 1, 1, 0.0),
])
def test_bad_arguments_are_value_errors(backends: list[str], samples: int, concurrency: int,
                                        duration: float) -> None:
    with pytest.raises(ValueError):
        run_sandbox_bench(backends, samples, concurrency, duration, log=lambda _: None)


@pytest.mark.integration
def test_bench_measures_bwrap_and_remote_over_loopback() -> None:
    require_bwrap()
    lines: list[str] = []
    report = run_sandbox_bench(["bwrap", "remote"], samples=2, concurrency=3, duration_s=0.3,
                               log=lines.append)
    for name in ("bwrap", "remote"):
        check_backend_report(report["backends"][name], samples=2, concurrency=3)
    cell = report["backends"]["bwrap"]["python_cell"]  # a session where the backend keeps one
    assert cell["samples"] == 2 and cell["errors"] == 0 and cell["p50_ms"] > 0
    assert "python_cell" not in report["backends"]["remote"]
    assert report["backends"]["bwrap"]["isolation"] in ("unprivileged-uid", "root-no-caps",
                                                       "self")
    assert any("remote" in line for line in lines)

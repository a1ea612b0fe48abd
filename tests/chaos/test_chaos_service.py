"""The service under seeded faults (`treadle.bench.chaos`): every invariant holds.

The CI-sized run replays two jobs while each kind of process fault lands once —
the service killed -9 and restarted (also right after a submit, a cancel, during a
weight update), stopped and continued, an engine killed or stopped — and the
readers' connections are reset, cut mid-line, stalled and left half-open. Every
planned trajectory is handed to every reader once, in dense seqs, with the bytes
the store holds; nothing is left running; no error is unclassified; the log has no
traceback; SQLite's integrity check passes. `--chaos-long` adds longer runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from treadle.bench.chaos import PROCESS_FAULTS, ChaosConfig, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _assert_clean(report: dict[str, Any], config: ChaosConfig) -> None:
    problems = {k: report[k] for k in ("lost", "duplicated", "unstable", "misclassified",
                                        "hung") if report[k]}
    assert not problems, (problems, report["job_views"])
    assert report["integrity_check"] == "ok"
    assert report["unexpected_log_lines"] == [], report["unexpected_log_lines"]
    assert report["reader_errors"] == []
    assert report["ok"]
    # The faults did land: a run without them would prove nothing.
    faults = report["faults"]
    assert sum(faults["process"].values()) == config.faults
    if config.faults >= len(PROCESS_FAULTS):
        assert set(faults["process"]) == set(PROCESS_FAULTS)
    assert sum(faults["network"].values()) > 0 and faults["hang_ups"] > 0
    assert faults["service_starts"] > 1  # it was killed and came back
    # What the restarts cost: the turns in flight, nothing journaled (a replayed
    # trajectory calls no tool that could not be brought back).
    tokens = report["tokens"]
    assert tokens["in_flight_at_restarts"] > 0 and tokens["discarded_by_resumes"] == 0


def test_a_ci_sized_run_loses_duplicates_and_hangs_nothing(tmp_path: Path) -> None:
    # A deadline well inside pytest's timeout: a slow reader is reported as hung, with
    # the report, instead of the test being killed without one.
    config = ChaosConfig(seed=0, jobs=2, trajectories=64, faults=len(PROCESS_FAULTS),
                         fault_gap_s=1.0, time_scale=0.1, deadline_s=180.0)
    _assert_clean(run_chaos(config, tmp_path, say=lambda _m: None), config)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_long_run(tmp_path: Path, seed: int, request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("--chaos-long"):
        pytest.skip("long chaos runs need --chaos-long")
    config = ChaosConfig(seed=seed, jobs=4, trajectories=256, faults=3 * len(PROCESS_FAULTS),
                         fault_gap_s=2.0, time_scale=0.2, followers=3, hang_ups=8)
    _assert_clean(run_chaos(config, tmp_path, say=lambda _m: None), config)

"""Crash recovery: a real process writing the store is killed with SIGKILL mid-job."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from store_crash_child import result_for

from treadle.store import JobStatus, PlannedTrajectory, Store
from treadle.types import TrajectoryStatus

HERE = Path(__file__).parent
PLANNED = 50 * 16


def _run_child(db: Path, kill_after: int | None,
               hold: bool = False) -> list[tuple[int, str]]:
    """Run the child; SIGKILL it once it has reported `kill_after` finishes (with
    `hold`, once it has then started one more trajectory and holds it in flight)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    held = [] if not hold or kill_after is None else [str(kill_after)]
    proc = subprocess.Popen([sys.executable, str(HERE / "store_crash_child.py"), str(db), "job",
                             *held], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    reported: list[tuple[int, str]] = []
    try:
        for line in proc.stdout:
            seq, tid = line.split()
            if seq == "running":  # its start committed, its finish will not come
                proc.send_signal(signal.SIGKILL)
                break
            reported.append((int(seq), tid))
            if kill_after is not None and len(reported) >= kill_after and not hold:
                # The child is still writing flat out: the kill lands anywhere,
                # inside a transaction or between two.
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.stdout.close()
        proc.wait(timeout=60)
    if kill_after is None:
        assert proc.returncode == 0
    else:
        assert proc.returncode == -signal.SIGKILL
    return reported


def _check_consistent(db: Path, reported: list[tuple[int, str]]) -> int:
    """The file as a fresh process sees it; returns how many results it holds."""
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    with Store(db) as store:
        info = store.job("job")
        deliveries = list(store.iter_results("job", page_size=64))
        # Dense seqs, one per trajectory, each with its intact record.
        assert [d.seq for d in deliveries] == list(range(1, info.delivered + 1))
        assert len({d.trajectory_id for d in deliveries}) == len(deliveries)
        for d in deliveries:
            t = d.trajectory()
            p = PlannedTrajectory(t.trajectory_id, t.key.group_id, t.task_id, t.key.repetition)
            assert t == result_for(p)
        # Everything the child reported had committed (a report follows its commit).
        by_seq = {d.seq: d.trajectory_id for d in deliveries}
        assert all(by_seq.get(seq) == tid for seq, tid in reported)
        counts = info.counts
        assert counts[TrajectoryStatus.COMPLETED] == info.delivered
        assert counts[TrajectoryStatus.PENDING] + counts[TrajectoryStatus.RUNNING] == \
            PLANNED - info.delivered
        # The child runs one trajectory at a time: at most one was in flight.
        assert counts[TrajectoryStatus.RUNNING] <= 1
        # Reporting a finished trajectory again (a re-run after the crash) is no delivery.
        if deliveries:
            last = deliveries[-1].trajectory()
            assert store.finish("job", last).duplicate
        assert store.job("job").delivered == info.delivered
        return info.delivered


@pytest.mark.integration
def test_kill_9_mid_job_then_resume(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    delivered = 0
    for kill_after in (1, 57, 301):
        reported = _run_child(db, kill_after)
        assert reported[0][0] == delivered + 1  # the resumed run continues the numbering
        delivered = _check_consistent(db, reported)
        assert delivered >= reported[-1][0]
    # Those kills land anywhere, between two transactions too, where nothing is in
    # flight; this one lands with a trajectory started and not finished.
    reported = _run_child(db, 5, hold=True)
    assert [seq for seq, _ in reported] == list(range(delivered + 1, delivered + 6))
    delivered = _check_consistent(db, reported)
    with Store(db) as store:
        in_flight = [s for s in store.unfinished("job") if s.status is TrajectoryStatus.RUNNING]
    assert len(in_flight) == 1, in_flight
    reported = _run_child(db, None)  # finish the job
    assert [seq for seq, _ in reported] == list(range(delivered + 1, PLANNED + 1))
    assert _check_consistent(db, reported) == PLANNED
    with Store(db) as store:
        assert store.job("job").status is JobStatus.COMPLETED
        for s in in_flight:  # the one killed in flight was run again: a second attempt
            assert store.trajectory_state("job", s.trajectory_id).attempts == s.attempts + 1
        recovered = [e for e in store.events("job", limit=10_000) if e.kind == "recovered"]
        assert sum(e.payload["in_flight"] for e in recovered) >= len(in_flight)

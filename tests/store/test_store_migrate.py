"""Files written at an older schema version open with their jobs intact."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

from store_helpers import FakeClock, plan, random_trajectory

from treadle.store import JobStatus, Store, dumps_record, trajectory_to_record
from treadle.store.schema import MIGRATIONS, SCHEMA_VERSION
from treadle.types import TrajectoryStatus

SPEC = {"request": {"tasks": [{"id": "task-0", "prompt": "ünïcode " * 500}], "n": 3}}


def _version_1_file(path: Path) -> list[str]:
    """A store as version 1 wrote it: a running job of 3 trajectories (one finished,
    one running, one pending) with its events, and a cancelled job of 1. Returns the
    finished trajectory's record."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    planned = plan(1, 3)
    record = dumps_record(trajectory_to_record(
        random_trajectory(random.Random(1), planned[0], TrajectoryStatus.COMPLETED)))
    conn.execute("INSERT INTO jobs VALUES ('j', ?, 'running', NULL, 1000.0, 1001.0, NULL, 3, 1)",
                 (json.dumps(SPEC),))
    conn.execute("INSERT INTO jobs VALUES ('c', '{}', 'cancelled', 'stop', 999.0, NULL, "
                 "1002.0, 1, 1)")
    rows = [("j", planned[0].trajectory_id, 0, "completed", 1, 1, record),
            ("j", planned[1].trajectory_id, 1, "running", 1, None, None),
            ("j", planned[2].trajectory_id, 2, "pending", 0, None, None),
            ("c", "c-0", 0, "aborted", 0, 1, "{}")]
    for job_id, tid, pos, status, attempts, seq, rec in rows:
        conn.execute("INSERT INTO trajectories (job_id, trajectory_id, pos, group_id, task_id, "
                     "repetition, status, attempts, seq, record) "
                     "VALUES (?, ?, ?, 'j-g0', 'task-0', ?, ?, ?, ?, ?)",
                     (job_id, tid, pos, pos, status, attempts, seq, rec))
    conn.execute("INSERT INTO events (job_id, kind, payload, at) "
                 "VALUES ('j', 'job_created', '{\"planned\": 3}', 1000.0)")
    conn.close()
    return [record]


def test_a_version_1_file_migrates_keeping_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    [record] = _version_1_file(path)
    planned = plan(1, 3)
    with Store(path, clock=FakeClock(2000.0)) as store:
        assert store.job_spec("j") == SPEC and store.job_spec("c") == {}
        info = store.job("j")
        assert (info.status, info.planned, info.delivered) == (JobStatus.RUNNING, 3, 1)
        assert info.counts[TrajectoryStatus.COMPLETED] == 1
        assert info.counts[TrajectoryStatus.RUNNING] == info.counts[TrajectoryStatus.PENDING] == 1
        assert sum(info.counts.values()) == 3
        assert store.job("c").counts[TrajectoryStatus.ABORTED] == 1
        assert [d.record_json for d in store.results("j")] == [record]
        assert [e.kind for e in store.events("j")] == ["job_created"]
        # It goes on where version 1 left it.
        assert [j.job_id for j in store.recover()] == ["j"]
        assert store.job("j").counts[TrajectoryStatus.PENDING] == 2
        assert store.start("j", planned[1].trajectory_id) == 1
        finish = store.finish("j", random_trajectory(random.Random(2), planned[2],
                                                     TrajectoryStatus.COMPLETED))
        assert finish.seq == 2
        assert store.cancel("j").counts[TrajectoryStatus.ABORTED] == 1
        store.delete_job("c")
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    columns = {r[1] for r in raw.execute("PRAGMA table_info(jobs)")}
    assert "delivered" in columns
    # The old column stays, empty: the job row no longer carries the request.
    assert raw.execute("SELECT DISTINCT spec FROM jobs").fetchall() == [("",)]
    assert {f"n_{s.value}" for s in TrajectoryStatus} <= columns
    indexes = {r[1] for r in raw.execute("PRAGMA index_list(jobs)")}
    assert "jobs_by_status" in indexes
    assert raw.execute("SELECT job_id FROM job_specs").fetchall() == [("j",)]
    raw.close()


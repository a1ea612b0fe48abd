"""Job owners and trainer keys: an owner is set with its job and survives reopening;
jobs are listed newest first, all or one owner's; trainer keys are kept as digests,
listed, revoked; a version 2 file gains both. A job's states and one result by id."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest
from store_helpers import FakeClock, plan, random_trajectory

from treadle.store import NotFound, Store, StoreConflict
from treadle.store.schema import MIGRATIONS, SCHEMA_VERSION
from treadle.types import TrajectoryStatus


def test_a_jobs_owner_is_kept_with_it(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path, clock=FakeClock()) as store:
        assert store.create_job("a", {}, plan(1, 2, "a"), owner="run-a").owner == "run-a"
        assert store.create_job("x", {}, plan(1, 1, "x")).owner is None
        store.cancel("a")
    with Store(path) as store:
        assert (store.job("a").owner, store.job("x").owner) == ("run-a", None)


def test_recent_jobs_newest_first_all_or_one_owners(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store(tmp_path / "s.db", clock=clock) as store:
        for job, owner in (("a1", "run-a"), ("x", None), ("b", "run-b"), ("a2", "run-a")):
            clock.now += 1.0
            store.create_job(job, {}, plan(1, 1, job), owner=owner)
        assert [j.job_id for j in store.recent_jobs(10)] == ["a2", "b", "x", "a1"]
        assert [j.job_id for j in store.recent_jobs(2)] == ["a2", "b"]
        assert [j.job_id for j in store.recent_jobs(10, owner="run-a")] == ["a2", "a1"]
        assert store.recent_jobs(10, owner="run-c") == []
        with pytest.raises(ValueError):
            store.recent_jobs(0)


def test_a_jobs_states_in_plan_order_and_one_result_by_id(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", clock=FakeClock()) as store:
        planned = plan(2, 2, "j")
        store.create_job("j", {}, planned)
        done = random_trajectory(random.Random(0), planned[2], TrajectoryStatus.COMPLETED)
        store.start("j", done.trajectory_id)
        seq = store.finish("j", done).seq
        states = store.states("j")
        assert [s.trajectory_id for s in states] == [p.trajectory_id for p in planned]
        assert [s.seq for s in states] == [None, None, seq, None]
        found = store.result("j", done.trajectory_id)
        assert found is not None and (found.seq, found.trajectory().reward) == (seq, done.reward)
        assert store.result("j", planned[0].trajectory_id) is None  # not finished
        with pytest.raises(NotFound):
            store.result("j", "no-such")
        with pytest.raises(NotFound):
            store.states("nothing")


def test_trainer_keys_are_digests_listed_and_revoked(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    digest = "ab" * 32
    with Store(path, clock=FakeClock(5.0)) as store:
        kept = store.add_trainer_key("k1", digest, "run-a")
        assert (kept.key_id, kept.digest, kept.trainer_run, kept.created_at) == (
            "k1", digest, "run-a", 5.0)
        with pytest.raises(StoreConflict):
            store.add_trainer_key("k2", digest, "run-b")  # one digest, one key
        with pytest.raises(StoreConflict):
            store.add_trainer_key("k1", "cd" * 32, "run-b")
        store.add_trainer_key("k2", "cd" * 32, "run-b")
    with Store(path) as store:
        assert [k.key_id for k in store.trainer_keys()] == ["k1", "k2"]
        store.delete_trainer_key("k1")
        with pytest.raises(NotFound):
            store.delete_trainer_key("k1")
        assert [k.trainer_run for k in store.trainer_keys()] == ["run-b"]


def test_a_version_2_file_gains_owners_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for step in MIGRATIONS[:2]:
        for statement in step:
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 2")
    conn.execute("INSERT INTO jobs (job_id, spec, status, created_at, planned, n_pending) "
                 "VALUES ('old', '', 'queued', 1.0, 0, 0)")
    conn.execute("INSERT INTO job_specs (job_id, spec) VALUES ('old', '{}')")
    conn.close()
    with Store(path, clock=FakeClock()) as store:
        assert SCHEMA_VERSION == 5
        assert store.job("old").owner is None and store.trainer_keys() == []
        assert store.create_job("new", {}, plan(1, 1, "new"), owner="r").owner == "r"
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    raw.close()

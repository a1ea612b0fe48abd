"""The SQLite store: jobs, delivery order, cursors, exactly-once, cancel, recovery."""

from __future__ import annotations

import random
import sqlite3
import threading
from pathlib import Path

import pytest
from store_helpers import FakeClock, newer_schema_file, plan, random_trajectory

from treadle.store import (
    JobStatus,
    NotFound,
    PlannedTrajectory,
    SchemaError,
    Store,
    StoreConflict,
    trajectory_to_record,
)
from treadle.store.schema import SCHEMA_VERSION
from treadle.types import FailureStage, GroupKey, Trajectory, TrajectoryStatus

SPEC = {"tasks": [{"id": "task-0", "prompt": "2+2?"}], "n": 4, "sampling": {"t": 1.0}}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> Store:
    return Store(":memory:", clock=clock)


def _done(p: PlannedTrajectory, seed: int = 0,
          status: TrajectoryStatus = TrajectoryStatus.COMPLETED) -> Trajectory:
    return random_trajectory(random.Random(f"{p.trajectory_id}:{seed}"), p, status)


def test_create_job_stores_spec_plan_and_times(store: Store, clock: FakeClock) -> None:
    planned = plan(3, 4)
    info = store.create_job("j", SPEC, planned)
    assert info.status is JobStatus.QUEUED and info.created_at == 1000.0
    assert (info.planned, info.delivered, info.started_at, info.finished_at) == (12, 0, None, None)
    assert info.counts[TrajectoryStatus.PENDING] == 12
    assert sum(info.counts.values()) == 12 and set(info.counts) == set(TrajectoryStatus)
    assert store.job_spec("j") == SPEC
    assert [s.trajectory_id for s in store.unfinished("j")] == [p.trajectory_id for p in planned]
    assert [e.kind for e in store.events("j")] == ["job_created"]


def test_job_ids_list_every_job_oldest_first(store: Store, clock: FakeClock) -> None:
    assert store.job_ids() == []
    for job_id in ("b", "a", "c"):
        store.create_job(job_id, SPEC, plan(1, 1))
        clock.now += 1.0
    store.cancel("a")
    assert store.job_ids() == ["b", "a", "c"]


def test_create_job_conflicts(store: Store) -> None:
    store.create_job("j", SPEC, plan(1, 2))
    with pytest.raises(StoreConflict, match="already exists"):
        store.create_job("j", SPEC, plan(1, 2))
    twice = [PlannedTrajectory("t", "g", "task", 0), PlannedTrajectory("t", "g", "task", 1)]
    with pytest.raises(StoreConflict, match="not unique"):
        store.create_job("k", SPEC, twice)
    with pytest.raises(NotFound):
        store.job("k")  # nothing of the refused job was written
    assert store.create_job("empty", SPEC, []).status is JobStatus.COMPLETED


def test_unknown_ids_raise_not_found(store: Store) -> None:
    store.create_job("j", SPEC, plan(1, 1))
    for call in (lambda: store.job("x"), lambda: store.job_spec("x"),
                 lambda: store.results("x"), lambda: store.unfinished("x"),
                 lambda: store.events("x"), lambda: store.add_event("x", "k"),
                 lambda: store.start("j", "nope"), lambda: store.delete_job("x"),
                 lambda: store.trajectory_state("j", "nope")):
        with pytest.raises(NotFound):
            call()
    stray = Trajectory("nope", GroupKey("g", 0), status=TrajectoryStatus.COMPLETED)
    with pytest.raises(NotFound):
        store.finish("j", stray)


def test_start_counts_attempts_and_runs_the_job(store: Store, clock: FakeClock) -> None:
    p = plan(1, 2)
    store.create_job("j", SPEC, p)
    clock.now = 1005.0
    assert store.start("j", p[0].trajectory_id) == 0
    clock.now = 1010.0
    assert store.start("j", p[0].trajectory_id) == 1  # started again: second attempt
    info = store.job("j")
    assert info.status is JobStatus.RUNNING and info.started_at == 1005.0
    assert info.counts[TrajectoryStatus.RUNNING] == 1
    assert store.trajectory_state("j", p[0].trajectory_id).attempts == 2


def test_seq_follows_completion_order_and_completes_the_job(store: Store,
                                                           clock: FakeClock) -> None:
    planned = plan(4, 4)
    store.create_job("j", SPEC, planned)
    order = list(planned)
    random.Random(5).shuffle(order)
    for i, p in enumerate(order, 1):
        clock.now = 2000.0 + i
        store.start("j", p.trajectory_id)
        result = store.finish("j", _done(p))
        assert (result.seq, result.duplicate) == (i, False)
    info = store.job("j")
    assert info.status is JobStatus.COMPLETED and info.finished_at == 2016.0
    assert info.delivered == 16 and info.counts[TrajectoryStatus.COMPLETED] == 16
    deliveries = store.results("j", limit=100)
    assert [d.seq for d in deliveries] == list(range(1, 17))
    assert [d.trajectory_id for d in deliveries] == [p.trajectory_id for p in order]
    assert [d.trajectory() for d in deliveries] == [_done(p) for p in order]
    assert deliveries[0].record() == trajectory_to_record(_done(order[0]))
    assert store.unfinished("j") == []


def test_finish_twice_is_one_delivery(store: Store) -> None:
    p = plan(1, 3)
    store.create_job("j", SPEC, p)
    first = store.finish("j", _done(p[1], seed=1))
    again = store.finish("j", _done(p[1], seed=2, status=TrajectoryStatus.TIMEOUT))
    assert (first.seq, first.duplicate) == (1, False)
    assert (again.seq, again.duplicate) == (1, True)
    assert store.finish("j", _done(p[0])).seq == 2
    deliveries = store.results("j")
    assert [d.trajectory_id for d in deliveries] == [p[1].trajectory_id, p[0].trajectory_id]
    assert deliveries[0].trajectory() == _done(p[1], seed=1)  # the first record is kept
    info = store.job("j")
    assert info.delivered == 2 and info.status is JobStatus.RUNNING
    assert store.start("j", p[1].trajectory_id) is None  # finished: do not run it again
    kinds = [e.kind for e in store.events("j")]
    assert kinds.count("duplicate_finish") == 1


def test_finish_refuses_non_terminal_and_mismatched_results(store: Store) -> None:
    p = plan(1, 2)
    store.create_job("j", SPEC, p)
    running = _done(p[0])
    running.status = TrajectoryStatus.RUNNING
    with pytest.raises(StoreConflict, match="not terminal"):
        store.finish("j", running)
    wrong = _done(p[0])
    wrong.key = GroupKey(p[0].group_id, 1)
    with pytest.raises(StoreConflict, match="the plan says"):
        store.finish("j", wrong)
    wrong_task = _done(p[0])
    wrong_task.task_id = "other"
    with pytest.raises(StoreConflict, match="the plan says"):
        store.finish("j", wrong_task)
    assert store.job("j").delivered == 0


def test_cursor_resumes_exactly_where_it_stopped(store: Store) -> None:
    planned = plan(5, 5)
    store.create_job("j", SPEC, planned)
    rng = random.Random(7)
    pending = list(planned)
    rng.shuffle(pending)
    received: list[str] = []
    cursor = 0
    while pending or len(received) < len(planned):
        # Finish a few, then read a page of random size from the cursor: a client
        # streaming while the job runs, reconnecting between pages.
        for _ in range(rng.randint(0, 4)):
            if pending:
                store.finish("j", _done(pending.pop()))
        page = store.results("j", after=cursor, limit=rng.randint(1, 6))
        assert [d.seq for d in page] == list(range(cursor + 1, cursor + 1 + len(page)))
        received += [d.trajectory_id for d in page]
        if page:
            cursor = page[-1].seq
    assert sorted(received) == sorted(p.trajectory_id for p in planned)
    assert len(set(received)) == len(received)
    assert store.results("j", after=cursor) == []


@pytest.mark.parametrize("page_size", [1, 3, 25, 26, 100])
def test_iter_results_pages_give_the_same_stream(store: Store, page_size: int) -> None:
    planned = plan(5, 5)
    store.create_job("j", SPEC, planned)
    for p in planned:
        store.finish("j", _done(p))
    seqs = [d.seq for d in store.iter_results("j", page_size=page_size)]
    assert seqs == list(range(1, 26))
    assert [d.seq for d in store.iter_results("j", after=20, page_size=page_size)] == \
        [21, 22, 23, 24, 25]
    with pytest.raises(ValueError):
        store.results("j", limit=0)


def test_cancel_aborts_the_rest_and_ends_the_stream(store: Store, clock: FakeClock) -> None:
    p = plan(2, 3)
    store.create_job("j", SPEC, p)
    store.finish("j", _done(p[0]))
    store.start("j", p[1].trajectory_id)  # in flight when cancelled
    clock.now = 3000.0
    info = store.cancel("j", reason="trainer stopped")
    assert info.status is JobStatus.CANCELLED and info.reason == "trainer stopped"
    assert info.finished_at == 3000.0 and info.delivered == 6
    assert info.counts[TrajectoryStatus.ABORTED] == 5
    assert info.counts[TrajectoryStatus.COMPLETED] == 1
    aborted = [d.trajectory() for d in store.results("j")[1:]]
    assert [t.trajectory_id for t in aborted] == [x.trajectory_id for x in p[1:]]
    for t in aborted:
        assert t.status is TrajectoryStatus.ABORTED and t.reason == "trainer stopped"
        assert t.reward is None and t.timings.finished_at == 3000.0
    assert aborted[0].key == GroupKey(p[1].group_id, p[1].repetition)
    # The in-flight one reports late: a duplicate, not a seventh delivery.
    late = store.finish("j", _done(p[1]))
    assert late.duplicate and late.seq == 2
    assert store.start("j", p[2].trajectory_id) is None
    assert store.cancel("j").reason == "trainer stopped"  # cancelling again changes nothing
    assert [e.kind for e in store.events("j")][-2:] == ["job_cancelled", "duplicate_finish"]


def test_cancel_of_a_completed_job_changes_nothing(store: Store) -> None:
    p = plan(1, 1)
    store.create_job("j", SPEC, p)
    store.finish("j", _done(p[0]))
    assert store.cancel("j").status is JobStatus.COMPLETED


def test_fail_ends_the_rest_as_errors_without_reward(store: Store) -> None:
    p = plan(1, 600)  # more than one internal batch
    store.create_job("j", SPEC, p)
    store.finish("j", _done(p[0]))
    info = store.fail("j", "engines lost", FailureStage.ENGINE)
    assert info.status is JobStatus.FAILED and info.counts[TrajectoryStatus.ERROR] == 599
    errors = [d.trajectory() for d in store.iter_results("j", after=1)]
    assert len(errors) == 599
    assert all(t.infra_failure and t.reward is None and t.failure_stage is FailureStage.ENGINE
               for t in errors)


def test_recover_requeues_in_flight_trajectories(store: Store) -> None:
    p = plan(1, 3)
    store.create_job("j", SPEC, p)
    store.create_job("done", SPEC, [])
    store.start("j", p[0].trajectory_id)
    store.start("j", p[1].trajectory_id)
    store.finish("j", _done(p[1]))
    jobs = store.recover()
    assert [j.job_id for j in jobs] == ["j"]
    assert jobs[0].counts[TrajectoryStatus.RUNNING] == 0
    assert jobs[0].counts[TrajectoryStatus.PENDING] == 2
    states = {s.trajectory_id: s for s in store.unfinished("j")}
    assert set(states) == {p[0].trajectory_id, p[2].trajectory_id}
    assert states[p[0].trajectory_id].attempts == 1
    assert store.start("j", p[0].trajectory_id) == 1  # the re-run is attempt 1
    recovered = [e for e in store.events("j") if e.kind == "recovered"]
    assert [e.payload for e in recovered] == [{"in_flight": 1}]


def test_events_page_and_keep_payloads(store: Store, clock: FakeClock) -> None:
    store.create_job("j", SPEC, plan(1, 1))
    ids = [store.add_event("j", "engine_slow", {"engine": "e1", "i": i}, trajectory_id="t")
           for i in range(5)]
    assert ids == sorted(ids)
    page = store.events("j", after=ids[1], limit=2)
    assert [e.payload["i"] for e in page] == [2, 3]
    assert page[0].trajectory_id == "t" and page[0].at == clock.now


def test_delete_job_removes_everything(store: Store) -> None:
    p = plan(1, 2)
    store.create_job("j", SPEC, p)
    store.finish("j", _done(p[0]))
    store.delete_job("j")
    with pytest.raises(NotFound):
        store.job("j")
    store.create_job("j", SPEC, p)  # the id is free again
    assert store.job("j").delivered == 0 and len(store.events("j")) == 1


def test_threads_finishing_at_once_get_dense_unique_seqs(store: Store) -> None:
    planned = plan(8, 16)
    store.create_job("j", SPEC, planned)
    chunks = [planned[i::4] for i in range(4)]

    def work(chunk: list[PlannedTrajectory]) -> None:
        for p in chunk:
            store.start("j", p.trajectory_id)
            store.finish("j", _done(p))
            store.finish("j", _done(p))  # and a duplicate

    threads = [threading.Thread(target=work, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [d.seq for d in store.iter_results("j")]
    assert seqs == list(range(1, 129))
    assert store.job("j").status is JobStatus.COMPLETED


def test_file_store_uses_wal_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    p = plan(1, 2)
    with Store(path, clock=FakeClock()) as store:
        assert store.journal_mode == "wal"
        store.create_job("j", SPEC, p)
        store.finish("j", _done(p[0]))
        assert (tmp_path / "t.db-wal").exists()
    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()
    with Store(path) as again:
        assert again.results("j")[0].trajectory() == _done(p[0])
        assert again.job("j").delivered == 1


def test_schema_versions(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="newer than this treadle"):
        Store(newer_schema_file(tmp_path / "newer.db"))
    foreign = tmp_path / "foreign.db"
    raw = sqlite3.connect(foreign)
    raw.execute("CREATE TABLE notes (x)")
    raw.commit()
    raw.close()
    with pytest.raises(SchemaError, match="not a treadle store"):
        Store(foreign)
    fresh = tmp_path / "fresh.db"
    Store(fresh).close()
    Store(fresh).close()  # a second open migrates nothing and fails nothing
    raw = sqlite3.connect(fresh)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()

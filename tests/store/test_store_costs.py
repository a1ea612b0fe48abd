"""What a store call costs does not grow with what it does not concern.

Measured in work SQLite does, not in time (the machine is shared and noisy): the WAL
frames a commit appends (pages written) and the progress handler's calls (taken at
the virtual machine's branches, so proportional to the rows a statement visits).
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from store_helpers import FakeClock, plan, random_trajectory

from treadle.store import JobStatus, PlannedTrajectory, Store
from treadle.types import FailureStage, GroupKey, Trajectory, TrajectoryStatus


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _minimal(p: PlannedTrajectory) -> Trajectory:
    return Trajectory(p.trajectory_id, GroupKey(p.group_id, p.repetition),
                      status=TrajectoryStatus.COMPLETED, task_id=p.task_id)


def _vm_steps(store: Store, fn: Callable[[], object]) -> int:
    """Progress-handler calls (one per VM branch taken) while `fn` runs."""
    steps = 0

    def tick() -> int:
        nonlocal steps
        steps += 1
        return 0  # go on

    store._conn.set_progress_handler(tick, 1)
    try:
        fn()
    finally:
        store._conn.set_progress_handler(None, 1)
    return steps


def _frames_per_finish(path: Path, spec_bytes: int) -> float:
    """WAL frames (pages) a finish writes, for a job whose spec holds `spec_bytes`."""
    planned = plan(1, 8)
    frames = 0
    with Store(path) as store:
        store.create_job("j", {"blob": "x" * spec_bytes}, planned)
        store.finish("j", _minimal(planned[0]))  # the job is running from here
        other = sqlite3.connect(path, isolation_level=None)
        for p in planned[1:5]:
            # Empty the WAL, finish one, and read how many frames the WAL holds.
            other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            store.finish("j", _minimal(p))
            busy, log, _ = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            assert busy == 0
            frames += log
        other.close()
    return frames / 4


def test_a_finish_writes_the_same_pages_whatever_the_spec_size(tmp_path: Path) -> None:
    small = _frames_per_finish(tmp_path / "small.db", 16)
    big = _frames_per_finish(tmp_path / "big.db", 4 << 20)  # ~1,000 pages of spec
    assert small == big
    assert small <= 8  # the trajectory's row, the job's row and counts, their indexes


def test_cancel_visits_each_trajectory_once(clock: FakeClock) -> None:
    """The work per cancelled trajectory is the same for a job 4x the size (paging
    from the start of the plan, or re-reading the job per trajectory, grows it)."""
    per_trajectory = []
    for n in (2000, 8000):
        store = Store(":memory:", clock=clock)
        planned = plan(n // 16, 16)
        store.create_job("j", {}, planned)
        for p in planned[: n // 4]:  # finished rows the walk has to pass
            store.finish("j", _minimal(p))
        per_trajectory.append(_vm_steps(store, lambda s=store: s.cancel("j")) / (n - n // 4))
        info = store.job("j")
        assert info.delivered == n and info.counts[TrajectoryStatus.ABORTED] == n - n // 4
        store.close()
    assert per_trajectory[1] <= per_trajectory[0] * 1.05, per_trajectory


def test_a_job_read_does_not_count_the_job(clock: FakeClock) -> None:
    steps = []
    for n in (16, 4096):
        store = Store(":memory:", clock=clock)
        planned = plan(n // 16, 16)
        store.create_job("j", {}, planned)
        store.start("j", planned[0].trajectory_id)
        store.finish("j", _minimal(planned[1]))
        steps.append(_vm_steps(store, lambda s=store: s.job("j")))
        store.close()
    assert steps[0] == steps[1]


def test_cancel_across_pages_with_finished_rows_between(clock: FakeClock) -> None:
    """Keyset pages with finished trajectories at and around the page boundaries."""
    from treadle.store.rows import PAGE
    store = Store(":memory:", clock=clock)
    planned = plan(1, 3 * PAGE + 7)
    store.create_job("j", {}, planned)
    done = {0, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 3 * PAGE + 6}
    done |= set(random.Random(3).sample(range(len(planned)), 200))
    order = sorted(done)
    random.Random(4).shuffle(order)
    for i in order:
        store.finish("j", _minimal(planned[i]))
    store.start("j", planned[2].trajectory_id)
    info = store.fail("j", "engines lost", FailureStage.ENGINE)
    assert info.status is JobStatus.FAILED and info.delivered == len(planned)
    deliveries = list(store.iter_results("j"))
    assert [d.seq for d in deliveries] == list(range(1, len(planned) + 1))
    assert [d.trajectory_id for d in deliveries[:len(order)]] == \
        [planned[i].trajectory_id for i in order]
    ended = [planned[i].trajectory_id for i in range(len(planned)) if i not in done]
    assert [d.trajectory_id for d in deliveries[len(order):]] == ended  # plan order
    assert {d.trajectory().status for d in deliveries[len(order):]} == {TrajectoryStatus.ERROR}
    assert info.counts[TrajectoryStatus.ERROR] == len(ended)
    assert info.counts[TrajectoryStatus.RUNNING] == info.counts[TrajectoryStatus.PENDING] == 0


@pytest.mark.parametrize("seed", range(4))
def test_kept_counts_equal_a_count_of_the_rows(tmp_path: Path, seed: int) -> None:
    """Random starts, finishes (and duplicates), recoveries, cancels and fails on a
    few jobs: after every call, JobInfo.counts equals a GROUP BY over the rows."""
    rng = random.Random(seed)
    path = tmp_path / "c.db"
    store = Store(path, clock=FakeClock())
    raw = sqlite3.connect(path)
    plans = {f"j{k}": plan(rng.randint(1, 4), rng.randint(1, 6), f"j{k}") for k in range(4)}
    for job_id, planned in plans.items():
        store.create_job(job_id, {}, planned)

    def check() -> None:
        for job_id in store.job_ids():
            counted = dict.fromkeys(TrajectoryStatus, 0)
            for status, n in raw.execute("SELECT status, count(*) FROM trajectories "
                                         "WHERE job_id = ? GROUP BY status", (job_id,)):
                counted[TrajectoryStatus(status)] = n
            assert store.job(job_id).counts == counted, job_id

    for _ in range(150):
        job_id = rng.choice(list(plans))
        p = rng.choice(plans[job_id])
        action = rng.random()
        if action < 0.4:
            store.start(job_id, p.trajectory_id)
        elif action < 0.8:
            store.finish(job_id, random_trajectory(rng, p))
        elif action < 0.9:
            store.recover()
        elif action < 0.95:
            store.cancel(job_id, "stop")
        else:
            store.fail(job_id, "lost", rng.choice(list(FailureStage)))
        check()
    store.delete_job("j0")
    assert raw.execute("SELECT count(*) FROM job_specs WHERE job_id = 'j0'").fetchone()[0] == 0
    raw.close()
    store.close()

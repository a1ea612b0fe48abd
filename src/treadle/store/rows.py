"""The statements behind `Store`'s calls, run inside the transaction the call began.

`Store` (db.py) owns the connection, its lock and the transactions, and states the
contracts; the functions here do one call's row work and never begin or end a
transaction themselves.

Costs. Nothing here reads or writes a job's spec (it lives in its own table,
`job_specs`, which only `create_job` and `job_spec` touch), so a finish costs the same
whatever the size of the request. `job_info` reads the per-status counts kept on the
job's row (`n_<status>`) instead of counting the job's trajectories. `end_job` visits
each of the job's trajectories once.

The counts' invariant: a job's `n_<status>` equals the number of its trajectories in
that status. Every statement that changes trajectories' statuses updates the counts
in the same transaction: through `move` for one trajectory, with the SET terms of
`counted` for many.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from treadle.store.errors import NotFound, StoreConflict
from treadle.store.jobs import Event, JobInfo, JobStatus, PlannedTrajectory, TrajectoryState
from treadle.store.record import dumps_record, trajectory_to_record
from treadle.types import FailureStage, GroupKey, Timings, Trajectory, TrajectoryStatus

STATE_COLUMNS = "trajectory_id, group_id, task_id, repetition, status, attempts, seq"
PAGE = 500  # trajectories per batch when cancelling or failing a large job


COUNT_COLUMNS = {status: f"n_{status.value}" for status in TrajectoryStatus}
_JOB_COLUMNS = ("status, reason, created_at, started_at, finished_at, planned, delivered, "
                "owner, " + ", ".join(COUNT_COLUMNS.values()))


def require_job(conn: sqlite3.Connection, job_id: str) -> None:
    if not conn.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone():
        raise NotFound(f"no job {job_id!r}")


def job_info(conn: sqlite3.Connection, job_id: str) -> JobInfo:
    """The job's state; NotFound if there is none."""
    row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    counts = {status: int(n) for status, n in zip(COUNT_COLUMNS, row[8:], strict=True)}
    return JobInfo(job_id, JobStatus(row[0]), row[1], row[2], row[3], row[4],
                   int(row[5]), int(row[6]), counts, owner=row[7])


def counted(changes: Mapping[TrajectoryStatus, int]) -> tuple[list[str], list[int]]:
    """SET terms, and their parameters, that add `changes` (status -> trajectories
    gained, negative for lost) to a job's counts in an UPDATE of its row."""
    terms, args = [], []
    for status, n in changes.items():
        if n:
            column = COUNT_COLUMNS[status]  # one of ours, never the caller's text
            terms.append(f"{column} = {column} + ?")
            args.append(n)
    return terms, args


@functools.cache
def _move_sql(was: TrajectoryStatus, now: TrajectoryStatus, delivered: bool) -> str:
    # Cached: it runs on every start and finish, with a dozen (was, now) pairs.
    terms = ["delivered = delivered + 1"] if delivered else []
    if was is not now:
        terms += [f"{COUNT_COLUMNS[was]} = {COUNT_COLUMNS[was]} - 1",
                  f"{COUNT_COLUMNS[now]} = {COUNT_COLUMNS[now]} + 1"]
    return f"UPDATE jobs SET {', '.join(terms)} WHERE job_id = ?"


def move(conn: sqlite3.Connection, job_id: str, was: TrajectoryStatus,
         now: TrajectoryStatus, at: float, delivered: bool = False) -> None:
    """One of the job's trajectories went from `was` to `now` at time `at` (started,
    or with `delivered`, finished): its counts follow, a queued job is running."""
    if delivered or was is not now:
        conn.execute(_move_sql(was, now, delivered), (job_id,))
    # Apart, and only where the job is queued: an UPDATE that sets `status` rewrites
    # its index entry (jobs_by_status) even to the same value, a page more per call.
    conn.execute(
        "UPDATE jobs SET status = ?, started_at = coalesce(started_at, ?) "
        "WHERE job_id = ? AND status = ?",
        (JobStatus.RUNNING.value, at, job_id, JobStatus.QUEUED.value))


def deliver(conn: sqlite3.Connection, job_id: str, trajectory_id: str,
            was: TrajectoryStatus, status: TrajectoryStatus, reason: str | None,
            record_json: str, now: float) -> int:
    """Give the job's next seq to an unfinished trajectory whose status was `was`,
    of a job queued or running; completes the job if it was the last. Returns the
    seq."""
    move(conn, job_id, was, status, now, delivered=True)
    planned, delivered, still_open = conn.execute(
        "SELECT planned, delivered, open FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
    conn.execute(
        "UPDATE trajectories SET status = ?, seq = ?, record = ?, reason = ?, "
        "finished_at = ? WHERE job_id = ? AND trajectory_id = ?",
        (status.value, delivered, record_json, reason, now, job_id, trajectory_id))
    if delivered == planned and not still_open:  # (a continuous job's plan may grow)
        conn.execute("UPDATE jobs SET status = ?, finished_at = ? WHERE job_id = ?",
                     (JobStatus.COMPLETED.value, now, job_id))
    return int(delivered)


def end_job(conn: sqlite3.Connection, job_id: str, status: JobStatus, reason: str,
            stage: FailureStage | None, now: float) -> JobInfo:
    """Cancel (`stage` None: ABORTED) or fail (ERROR at `stage`) a job that is not
    terminal: each unfinished trajectory gets a minimal record and the next seq, in
    plan order. Linear in the job: a keyset walk of the plan visits each trajectory
    once, and the job's row and counts are written once, at the end."""
    info = job_info(conn, job_id)
    if info.status.terminal:
        return info
    outcome = TrajectoryStatus.ABORTED if stage is None else TrajectoryStatus.ERROR
    delivered = info.delivered
    lost: Counter[TrajectoryStatus] = Counter()
    after = -1
    while True:
        # INDEXED BY: the planner may otherwise serve `seq IS NULL` from the
        # (job_id, seq) index and sort every unfinished row again for each page.
        rows = conn.execute(
            "SELECT rowid, pos, trajectory_id, group_id, task_id, repetition, status, attempts "
            "FROM trajectories INDEXED BY trajectories_by_pos "
            "WHERE job_id = ? AND pos > ? AND seq IS NULL ORDER BY pos LIMIT ?",
            (job_id, after, PAGE)).fetchall()
        updates = []
        for rowid, _, tid, group_id, task_id, repetition, was, attempts in rows:
            delivered += 1
            lost[TrajectoryStatus(was)] += 1
            t = Trajectory(trajectory_id=tid, key=GroupKey(group_id, int(repetition)),
                           status=outcome, reason=reason, failure_stage=stage,
                           attempt=max(int(attempts) - 1, 0),
                           timings=Timings(finished_at=now), task_id=task_id)
            updates.append((outcome.value, delivered, dumps_record(trajectory_to_record(t)),
                            reason, now, rowid))
        conn.executemany(
            "UPDATE trajectories SET status = ?, seq = ?, record = ?, reason = ?, "
            "finished_at = ? WHERE rowid = ?", updates)
        if len(rows) < PAGE:
            break
        after = int(rows[-1][1])
    ended = delivered - info.delivered
    changes = {s: -n for s, n in lost.items()}
    changes[outcome] = changes.get(outcome, 0) + ended
    terms, args = counted(changes)
    sets = ", ".join(["status = ?", "reason = ?", "finished_at = ?", "delivered = ?", *terms])
    conn.execute(f"UPDATE jobs SET {sets} WHERE job_id = ?",
                 (status.value, reason, now, delivered, *args, job_id))
    event(conn, job_id, None, f"job_{status.value}", {"reason": reason, "ended": ended}, now)
    return job_info(conn, job_id)


def event(conn: sqlite3.Connection, job_id: str, trajectory_id: str | None, kind: str,
          payload: Mapping[str, Any], now: float) -> int:
    """Append an event; returns its id."""
    cur = conn.execute(
        "INSERT INTO events (job_id, trajectory_id, kind, payload, at) VALUES (?, ?, ?, ?, ?)",
        (job_id, trajectory_id, kind,
         json.dumps(dict(payload), ensure_ascii=False, allow_nan=False, separators=(",", ":")),
         now))
    return int(cur.lastrowid or 0)


def state(row: tuple[Any, ...]) -> TrajectoryState:
    """A TrajectoryState from a row of STATE_COLUMNS."""
    tid, group_id, task_id, repetition, status, attempts, seq = row
    return TrajectoryState(tid, group_id, task_id, int(repetition), TrajectoryStatus(status),
                           int(attempts), None if seq is None else int(seq))


def add_planned(conn: sqlite3.Connection, job_id: str,
                planned: Sequence[PlannedTrajectory]) -> None:
    """Append `planned` to the job's trajectories, pending, after its last one;
    StoreConflict if a trajectory id is taken (the caller's transaction rolls back)."""
    pos = conn.execute("SELECT coalesce(max(pos), -1) + 1 FROM trajectories WHERE job_id = ?",
                       (job_id,)).fetchone()[0]
    try:
        conn.executemany(
            "INSERT INTO trajectories (job_id, trajectory_id, pos, group_id, task_id, "
            "repetition, status) VALUES (?, ?, ?, ?, ?, ?, ?)",
            ((job_id, p.trajectory_id, pos + i, p.group_id, p.task_id, p.repetition,
              TrajectoryStatus.PENDING.value) for i, p in enumerate(planned)))
    except sqlite3.IntegrityError:
        raise StoreConflict(f"job {job_id!r}: a trajectory id is taken") from None
    conn.execute("UPDATE jobs SET planned = planned + ?, n_pending = n_pending + ? "
                 "WHERE job_id = ?", (len(planned), len(planned), job_id))


def events(conn: sqlite3.Connection, job_id: str, after: int, limit: int) -> list[Event]:
    require_job(conn, job_id)
    found = conn.execute(
        "SELECT event_id, job_id, trajectory_id, kind, payload, at FROM events "
        "WHERE job_id = ? AND event_id > ? ORDER BY event_id LIMIT ?",
        (job_id, after, limit)).fetchall()
    return [Event(int(r[0]), r[1], r[2], r[3], json.loads(r[4]), float(r[5])) for r in found]


def merged_events(conn: sqlite3.Connection, job_id: str,
                  kinds: Sequence[str]) -> dict[str, dict[str, Any]]:
    require_job(conn, job_id)
    found = conn.execute(
        "SELECT kind, payload FROM events WHERE job_id = ? AND kind IN "
        f"({', '.join('?' * len(kinds))}) ORDER BY event_id", (job_id, *kinds)).fetchall()
    merged: dict[str, dict[str, Any]] = {kind: {} for kind in kinds}
    for kind, payload in found:
        merged[kind].update(json.loads(payload))
    return merged

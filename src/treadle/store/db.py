"""The durable store: jobs, their trajectories and results, events, in one SQLite file.

    store = Store("treadle.db")                      # WAL mode; ":memory:" for tests
    store.create_job("job-1", spec, planned)         # one transaction
    attempt = store.start("job-1", "t0")             # None: already finished, skip it
    store.finish("job-1", trajectory)                # -> Finish(seq, duplicate)
    page = store.results("job-1", after=cursor)      # resume a stream at a cursor

Contracts:

- Delivery. Each finished trajectory gets a per-job *sequence number* 1, 2, 3, ...
  in the order `finish` calls commit; `results(job, after=k)` returns those with seq
  > k in seq order, a page at a time. A client that remembers the last seq it
  processed resumes exactly there: the numbers are dense, so nothing is skipped, and
  each trajectory has one, so nothing is delivered twice.
- Exactly once. `finish` is idempotent by (job id, trajectory id): a second result
  for a finished trajectory (a re-run after a crash, a late result after a cancel)
  keeps the first record and its seq and returns ``Finish(seq, duplicate=True)``.
- Atomicity. Every call is one transaction (``BEGIN IMMEDIATE``), or, made inside a
  `batch`, one savepoint of the batch's transaction (a call that raises undoes its
  own writes only; the batch's calls commit together: `treadle.store.transactions`);
  a process killed at any instant leaves the file as of the last commit. In WAL
  mode with ``synchronous=NORMAL`` (the default) a committed call survives the
  process being killed; ``synchronous="FULL"`` makes it survive a power cut too, at
  an fsync per commit.
- Recovery. After a restart, `recover()` returns the unfinished jobs and puts their
  in-flight trajectories back to pending; `unfinished(job)` lists what to run again.
  Starting one again counts another attempt.
- Cancel and fail. `cancel` (status ABORTED) and `fail` (status ERROR) finish every
  unfinished trajectory of the job with a minimal record, delivered like any other,
  so a stream always ends with exactly `planned` results.
- Turn journal: `write_journal` keeps unfinished trajectories' completed turns,
  `journaled` reads one's back after a restart (`treadle.store.journal`).
- Continuous jobs (`create_job(..., continuous=True)`): the plan grows a GRPO group
  at a time and the trainer takes whole groups, each once, by a cursor; see
  `treadle.store.continuous`.
- Job status: queued (created) -> running (first trajectory started or finished) ->
  completed (every planned trajectory finished) | cancelled | failed.
- Ownership. A job's `owner` (the trainer run whose key submitted it; None: the
  admin's) is set by `create_job`, in its transaction, and never changes: the
  service shows a job only to its owner's keys and the admin's.
- Keys. Trainer keys made through the API are kept as their SHA-256 digests, never
  as keys: `add_trainer_key` stores one (a digest or a key id taken is a
  StoreConflict), `trainer_keys` lists them, `delete_trainer_key` revokes one.
- Time comes from the injected `clock` (seconds, a float; `time.time` by default).
- Costs. What `start`, `finish` and `job` cost does not depend on the size of the
  job's spec and grows with its trajectories only as an index lookup does: the spec
  is kept apart from the job's row, which every finish rewrites, and per-status
  counts are kept as trajectories change status, not counted on each read.
  `cancel` and `fail` are linear in the job's trajectories, in one transaction
  (every other call waits for it).
- Memory: the store keeps nothing per job in Python; results and events are read in
  pages (`iter_results` fetches one page per query). SQLite's page cache is its
  default (about 2 MB).
- Threads. One connection, serialised by a lock: any thread may call, one call (or
  batch) runs at a time. The calls block on disk, so asyncio code must not call
  them on the event loop: use `treadle.store.aio.AsyncStore`, which runs every call
  on one worker thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from treadle.store import continuous, journal, rows
from treadle.store.errors import NotFound, StoreConflict
from treadle.store.jobs import (
    Delivery,
    Event,
    Finish,
    JobInfo,
    JobStatus,
    PlannedTrajectory,
    TakenGroup,
    TrainerKey,
    TrajectoryState,
)
from treadle.store.journal import Journaled, JournalResume, JournalRow, JournalWrite
from treadle.store.record import dumps_record, trajectory_to_record
from treadle.store.rows import STATE_COLUMNS
from treadle.store.schema import migrate
from treadle.store.transactions import Transactions
from treadle.types import FailureStage, StaleChoice, Trajectory, TrajectoryStatus


class Store:
    """Jobs, trajectories and events in one SQLite file. See the module docstring."""

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time,
                 synchronous: Literal["NORMAL", "FULL"] = "NORMAL") -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path = str(path)
        self._clock = clock
        # isolation_level=None: no implicit transactions; every write says BEGIN itself.
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._tx = Transactions(self._conn)
        try:
            self._conn.execute("PRAGMA busy_timeout = 10000")
            # "wal" for a file; SQLite keeps "memory" for ":memory:".
            self.journal_mode = str(self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            self._conn.execute(f"PRAGMA synchronous = {synchronous}")
            self._conn.execute("PRAGMA foreign_keys = ON")
            migrate(self._conn)
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._tx.lock:
            self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs ---------------------------------------------------------------------------

    def create_job(self, job_id: str, spec: Mapping[str, Any],
                   planned: Sequence[PlannedTrajectory], *, owner: str | None = None,
                   continuous: bool = False) -> JobInfo:
        """Store a job and its plan in one transaction; StoreConflict if the id is taken
        or two planned trajectories share an id (ValueError/TypeError if `spec` is not
        JSON). A job with an empty plan is completed at once. `owner`: the trainer run
        it belongs to (None: the admin's). `continuous`: its plan grows by
        `launch_group` until `close_plan` (it is not completed before)."""
        spec_json = json.dumps(spec, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        ids = [p.trajectory_id for p in planned]
        if len(set(ids)) != len(ids):
            raise StoreConflict(f"job {job_id!r}: planned trajectory ids are not unique")
        now = self._clock()
        status = JobStatus.QUEUED if planned or continuous else JobStatus.COMPLETED
        with self._tx.write():
            if self._conn.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone():
                raise StoreConflict(f"job {job_id!r} already exists")
            self._conn.execute(
                "INSERT INTO jobs (job_id, spec, status, created_at, finished_at, planned, "
                "n_pending, owner, open) VALUES (?, '', ?, ?, ?, ?, ?, ?, ?)",
                (job_id, status.value, now, None if status is JobStatus.QUEUED else now,
                 len(planned), len(planned), owner, int(continuous)))
            self._conn.execute("INSERT INTO job_specs (job_id, spec) VALUES (?, ?)",
                               (job_id, spec_json))
            self._conn.executemany(
                "INSERT INTO trajectories (job_id, trajectory_id, pos, group_id, task_id, "
                "repetition, status) VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((job_id, p.trajectory_id, i, p.group_id, p.task_id, p.repetition,
                  TrajectoryStatus.PENDING.value) for i, p in enumerate(planned)))
            rows.event(self._conn, job_id, None, "job_created", {"planned": len(planned)}, now)
            return rows.job_info(self._conn, job_id)

    def add_trajectories(self, job_id: str, planned: Sequence[PlannedTrajectory]) -> JobInfo:
        """Add trajectories to the plan of an unfinished job (a sub-agent's session
        joins its parent's job); NotFound for no such job, StoreConflict if the job has
        ended or an id is taken. Its stream then ends after the new ones too."""
        now = self._clock()
        with self._tx.write():
            info = rows.job_info(self._conn, job_id)
            if info.status.terminal:
                raise StoreConflict(f"job {job_id!r} is {info.status.value}: nothing can join it")
            rows.add_planned(self._conn, job_id, planned)
            rows.event(self._conn, job_id, None, "planned_more", {"added": len(planned)}, now)
            return rows.job_info(self._conn, job_id)

    def job(self, job_id: str) -> JobInfo:
        """The job's state; NotFound if there is none."""
        with self._tx.read():
            return rows.job_info(self._conn, job_id)

    def job_spec(self, job_id: str) -> dict[str, Any]:
        """The spec given to create_job, decoded."""
        with self._tx.lock:
            row = self._conn.execute("SELECT spec FROM job_specs WHERE job_id = ?",
                                     (job_id,)).fetchone()
        if row is None:
            raise NotFound(f"no job {job_id!r}")
        spec: dict[str, Any] = json.loads(row[0])
        return spec

    def job_ids(self) -> list[str]:
        """Every job's id, oldest first."""
        with self._tx.read():
            return [r[0] for r in self._conn.execute(
                "SELECT job_id FROM jobs ORDER BY created_at, job_id")]

    def recent_jobs(self, limit: int, *, owner: str | None = None) -> list[JobInfo]:
        """Up to `limit` jobs, newest first: every job's, or with `owner` only that
        trainer run's (a scan of the jobs' rows: a store keeps thousands, not millions)."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        where, args = ("WHERE owner = ? ", (owner,)) if owner is not None else ("", ())
        with self._tx.read():
            ids = [r[0] for r in self._conn.execute(
                f"SELECT job_id FROM jobs {where}ORDER BY created_at DESC, job_id LIMIT ?",
                (*args, limit))]
            return [rows.job_info(self._conn, job_id) for job_id in ids]

    def unfinished_jobs(self) -> list[JobInfo]:
        """Jobs queued or running, oldest first."""
        with self._tx.read():
            ids = [r[0] for r in self._conn.execute(
                "SELECT job_id FROM jobs WHERE status IN (?, ?) ORDER BY created_at, job_id",
                (JobStatus.QUEUED.value, JobStatus.RUNNING.value))]
            return [rows.job_info(self._conn, job_id) for job_id in ids]

    def recover(self) -> list[JobInfo]:
        """At startup: put in-flight trajectories of unfinished jobs back to pending
        (an event "recovered" per job says how many) and return the unfinished jobs."""
        now = self._clock()
        with self._tx.write():
            ids = [r[0] for r in self._conn.execute(
                "SELECT job_id FROM jobs WHERE status IN (?, ?)",
                (JobStatus.QUEUED.value, JobStatus.RUNNING.value))]
            for job_id in ids:
                n = self._conn.execute(
                    "UPDATE trajectories SET status = ? WHERE job_id = ? AND status = ?",
                    (TrajectoryStatus.PENDING.value, job_id,
                     TrajectoryStatus.RUNNING.value)).rowcount
                if n:
                    terms, args = rows.counted({TrajectoryStatus.RUNNING: -n,
                                                TrajectoryStatus.PENDING: n})
                    self._conn.execute(f"UPDATE jobs SET {', '.join(terms)} WHERE job_id = ?",
                                       (*args, job_id))
                    rows.event(self._conn, job_id, None, "recovered", {"in_flight": n}, now)
        return self.unfinished_jobs()

    def cancel(self, job_id: str, reason: str = "cancelled") -> JobInfo:
        """Cancel a job: every unfinished trajectory is finished as ABORTED with `reason`.
        A job already completed, cancelled or failed is left as it is."""
        now = self._clock()
        with self._tx.write():
            journal.forget(self._conn, job_id)
            return rows.end_job(self._conn, job_id, JobStatus.CANCELLED, reason, None, now)

    def fail(self, job_id: str, reason: str,
             stage: FailureStage = FailureStage.RUNTIME) -> JobInfo:
        """Give a job up: every unfinished trajectory is finished as ERROR at `stage`."""
        now = self._clock()
        with self._tx.write():
            journal.forget(self._conn, job_id)
            return rows.end_job(self._conn, job_id, JobStatus.FAILED, reason, stage, now)

    def delete_job(self, job_id: str) -> None:
        """Remove a job with its trajectories and events (disk retention)."""
        with self._tx.write():
            if self._conn.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,)).rowcount == 0:
                raise NotFound(f"no job {job_id!r}")

    # -- trajectories -------------------------------------------------------------------

    def start(self, job_id: str, trajectory_id: str) -> int | None:
        """Mark a trajectory running and count the attempt. Returns the attempt index
        (0 the first time, for `Trajectory.attempt`), or None if it is already finished
        (cancelled meanwhile, or finished before a crash): do not run it."""
        now = self._clock()
        with self._tx.write():
            row = self._conn.execute(
                "SELECT seq, attempts, status FROM trajectories "
                "WHERE job_id = ? AND trajectory_id = ?", (job_id, trajectory_id)).fetchone()
            if row is None:
                raise NotFound(f"job {job_id!r} has no trajectory {trajectory_id!r}")
            seq, attempts, was = row
            if seq is not None:
                return None
            self._conn.execute(
                "UPDATE trajectories SET status = ?, attempts = attempts + 1, "
                "started_at = coalesce(started_at, ?) WHERE job_id = ? AND trajectory_id = ?",
                (TrajectoryStatus.RUNNING.value, now, job_id, trajectory_id))
            rows.move(self._conn, job_id, TrajectoryStatus(was), TrajectoryStatus.RUNNING, now)
            return int(attempts)

    def finish(self, job_id: str, trajectory: Trajectory) -> Finish:
        """Store a terminal trajectory and give it the job's next seq; idempotent.

        StoreConflict if its status is not terminal or its group, repetition or task
        differ from the plan; RecordError if it breaks a record invariant.
        """
        t = trajectory
        if not t.status.terminal:
            raise StoreConflict(f"trajectory {t.trajectory_id!r}: status {t.status.value!r} "
                                f"is not terminal")
        record_json = dumps_record(trajectory_to_record(t))
        now = self._clock()
        with self._tx.write():
            row = self._conn.execute(
                "SELECT seq, group_id, repetition, task_id, status FROM trajectories "
                "WHERE job_id = ? AND trajectory_id = ?", (job_id, t.trajectory_id)).fetchone()
            if row is None:
                raise NotFound(f"job {job_id!r} has no trajectory {t.trajectory_id!r}")
            seq, group_id, repetition, task_id, was = row
            if (group_id, repetition, task_id) != (t.key.group_id, t.key.repetition, t.task_id):
                raise StoreConflict(
                    f"trajectory {t.trajectory_id!r}: result is for group {t.key.group_id!r} "
                    f"repetition {t.key.repetition} task {t.task_id!r}, the plan says "
                    f"{group_id!r} {repetition} {task_id!r}")
            if seq is not None:
                rows.event(self._conn, job_id, t.trajectory_id, "duplicate_finish",
                           {"status": t.status.value, "kept_seq": seq}, now)
                return Finish(int(seq), duplicate=True)
            seq = rows.deliver(self._conn, job_id, t.trajectory_id, TrajectoryStatus(was),
                               t.status, t.reason, record_json, now)
            continuous.member_finished(self._conn, job_id, t)
            journal.forget(self._conn, job_id, t.trajectory_id)
            return Finish(seq, duplicate=False)

    def results(self, job_id: str, after: int = 0, limit: int = 100) -> list[Delivery]:
        """Up to `limit` results with seq > `after`, in seq order (`after=0`: from the
        first). An empty page at the end of a finished job means the stream is over."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        with self._tx.read():
            rows.require_job(self._conn, job_id)
            page = self._conn.execute(
                "SELECT seq, trajectory_id, record FROM trajectories "
                "WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (job_id, after, limit)).fetchall()
        return [Delivery(int(s), tid, rec) for s, tid, rec in page]

    def iter_results(self, job_id: str, after: int = 0,
                     page_size: int = 100) -> Iterator[Delivery]:
        """Every result with seq > `after`, one query per page (memory: one page)."""
        while True:
            page = self.results(job_id, after, page_size)
            yield from page
            if len(page) < page_size:
                return
            after = page[-1].seq

    def unfinished(self, job_id: str) -> list[TrajectoryState]:
        """The job's trajectories without a result, in plan order: what to run again."""
        with self._tx.read():
            rows.require_job(self._conn, job_id)
            found = self._conn.execute(
                f"SELECT {STATE_COLUMNS} FROM trajectories WHERE job_id = ? AND seq IS NULL "
                "ORDER BY pos", (job_id,)).fetchall()
        return [rows.state(r) for r in found]

    def states(self, job_id: str) -> list[TrajectoryState]:
        """Every trajectory of the job, finished or not, in plan order."""
        with self._tx.read():
            rows.require_job(self._conn, job_id)
            found = self._conn.execute(
                f"SELECT {STATE_COLUMNS} FROM trajectories WHERE job_id = ? ORDER BY pos",
                (job_id,)).fetchall()
        return [rows.state(r) for r in found]

    def result(self, job_id: str, trajectory_id: str) -> Delivery | None:
        """One trajectory's result; None while it is unfinished, NotFound if the job
        has no such trajectory."""
        with self._tx.read():
            row = self._conn.execute(
                "SELECT seq, record FROM trajectories WHERE job_id = ? AND trajectory_id = ?",
                (job_id, trajectory_id)).fetchone()
        if row is None:
            raise NotFound(f"job {job_id!r} has no trajectory {trajectory_id!r}")
        return None if row[0] is None else Delivery(int(row[0]), trajectory_id, row[1])

    def trajectory_state(self, job_id: str, trajectory_id: str) -> TrajectoryState:
        """One trajectory's bookkeeping; NotFound if the job has no such trajectory."""
        with self._tx.lock:
            row = self._conn.execute(
                f"SELECT {STATE_COLUMNS} FROM trajectories "
                "WHERE job_id = ? AND trajectory_id = ?", (job_id, trajectory_id)).fetchone()
        if row is None:
            raise NotFound(f"job {job_id!r} has no trajectory {trajectory_id!r}")
        return rows.state(row)

    # -- continuous jobs (treadle.store.continuous) --------------------------------------

    def launch_group(self, job_id: str, group_id: str, planned: Sequence[PlannedTrajectory],
                     *, close: bool = False) -> None:
        with self._tx.write():
            continuous.launch(self._conn, job_id, group_id, planned, close, self._clock())

    def close_plan(self, job_id: str) -> None:
        with self._tx.write():
            continuous.close(self._conn, job_id, self._clock())

    def groups_launched(self, job_id: str) -> tuple[int, int, int]:
        with self._tx.read():
            return continuous.launched(self._conn, job_id)

    def take(self, job_id: str, take_id: str, n: int, min_fresh: int | None = None,
             choice: StaleChoice = StaleChoice.FLAG) -> list[TakenGroup]:
        with self._tx.write():
            rows.require_job(self._conn, job_id)
            return continuous.take(self._conn, job_id, take_id, n, min_fresh, choice)

    def taken_groups(self, job_id: str, after: int = 0, limit: int = 100) -> list[TakenGroup]:
        with self._tx.read():
            return continuous.taken_groups(self._conn, job_id, after, limit)

    def stale_members(self, job_id: str, min_fresh: int) -> list[tuple[Delivery, int]]:
        with self._tx.read():
            return continuous.stale_members(self._conn, job_id, min_fresh)

    def restart(self, job_id: str, trajectory_id: str, new: PlannedTrajectory,
                version: int, *, sampled: int = 0, reason: str = "stale: restarted"
                ) -> int | None:
        with self._tx.write():
            return continuous.restart(self._conn, job_id, trajectory_id, new, version,
                                      sampled, reason, self._clock())

    # -- events -------------------------------------------------------------------------

    def add_event(self, job_id: str, kind: str, payload: Mapping[str, Any] | None = None,
                  trajectory_id: str | None = None) -> int:
        """Append a diagnostic event; returns its id."""
        now = self._clock()
        with self._tx.write():
            rows.require_job(self._conn, job_id)
            return rows.event(self._conn, job_id, trajectory_id, kind, payload or {}, now)

    def events(self, job_id: str, after: int = 0, limit: int = 100) -> list[Event]:
        """Up to `limit` of the job's events with id > `after`, oldest first."""
        with self._tx.read():
            return rows.events(self._conn, job_id, after, limit)

    def merged_events(self, job_id: str, kinds: Sequence[str]) -> dict[str, dict[str, Any]]:
        """For each of `kinds`, the payloads of the job's events of that kind merged,
        later keys winning (kinds of few events a job: a trainer's metric reports)."""
        with self._tx.read():
            return rows.merged_events(self._conn, job_id, kinds)

    # -- the turn journal (treadle.store.journal) ---------------------------------------

    def write_journal(self, entries: Sequence[JournalRow | JournalResume]) -> JournalWrite:
        """Completed turns of live attempts (those of finished trajectories or replaced
        attempts are not written) and resumes (each drops the turns it does not keep),
        in their order, in one transaction (`journal.write`)."""
        with self._tx.write():
            return journal.write(self._conn, entries)

    def journaled(self, job_id: str, trajectory_id: str) -> Journaled:
        with self._tx.read():
            return journal.read(self._conn, job_id, trajectory_id)

    # -- trainer keys -------------------------------------------------------------------

    def add_trainer_key(self, key_id: str, digest: str, trainer_run: str) -> TrainerKey:
        """Keep a trainer key's digest; StoreConflict if the id or the digest is taken."""
        now = self._clock()
        with self._tx.write():
            try:
                self._conn.execute("INSERT INTO trainer_keys (key_id, digest, trainer_run, "
                                   "created_at) VALUES (?, ?, ?, ?)",
                                   (key_id, digest, trainer_run, now))
            except sqlite3.IntegrityError:
                raise StoreConflict(f"trainer key {key_id!r}: its id or digest is taken"
                                    ) from None
        return TrainerKey(key_id, digest, trainer_run, now)

    def trainer_keys(self) -> list[TrainerKey]:
        """Every trainer key kept, oldest first."""
        with self._tx.read():
            found = self._conn.execute("SELECT key_id, digest, trainer_run, created_at FROM "
                                       "trainer_keys ORDER BY created_at, key_id").fetchall()
        return [TrainerKey(r[0], r[1], r[2], float(r[3])) for r in found]

    def delete_trainer_key(self, key_id: str) -> None:
        """Revoke a trainer key; NotFound if there is none by that id."""
        with self._tx.write():
            if self._conn.execute("DELETE FROM trainer_keys WHERE key_id = ?",
                                  (key_id,)).rowcount == 0:
                raise NotFound(f"no trainer key {key_id!r}")

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """The calls made inside commit together, once, at its end; each stays atomic
        (`treadle.store.transactions`: one fails alone; the commit failing fails all)."""
        return self._tx.batch()

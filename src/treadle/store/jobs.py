"""What the store hands out: job and trajectory states, results, events.

Plain frozen dataclasses, read at the time of the call; nothing here talks to
SQLite. `Delivery` keeps the record as its JSON text, so that a service streaming
NDJSON sends it without decoding and re-encoding it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from treadle.store.record import loads_record
from treadle.types import Trajectory, TrajectoryStatus


class JobStatus(enum.Enum):
    """Where a job stands; the last three are terminal."""

    QUEUED = "queued"  # created, no trajectory started yet
    RUNNING = "running"  # some trajectory started or finished
    COMPLETED = "completed"  # every planned trajectory finished
    CANCELLED = "cancelled"  # cancelled by the caller; unfinished ones became ABORTED
    FAILED = "failed"  # given up by treadle; unfinished ones became ERROR

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.CANCELLED, JobStatus.FAILED)


@dataclass(frozen=True, slots=True)
class PlannedTrajectory:
    """One trajectory a job will run, known when the job is created."""

    trajectory_id: str  # unique within the job
    group_id: str  # GRPO group (siblings share it)
    task_id: str  # the task it samples
    repetition: int  # 0..n-1 within the group


@dataclass(frozen=True, slots=True)
class JobInfo:
    """A job's state at the time of the call."""

    job_id: str  # the caller's id
    status: JobStatus  # see JobStatus
    reason: str | None  # why it was cancelled or failed
    created_at: float  # clock time of create_job
    started_at: float | None  # first trajectory started or finished
    finished_at: float | None  # status became terminal
    planned: int  # trajectories in the plan
    delivered: int  # results so far; also the last seq given
    counts: dict[TrajectoryStatus, int]  # trajectories per status, every status present
    # The trainer run whose key submitted it (None: the admin's); fixed at creation.
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class TrainerKey:
    """A trainer key made through the API, as stored: never the key, its digest only."""

    key_id: str  # its public name: what lists show and revocation names
    digest: str  # SHA-256 of the key, hex
    trainer_run: str  # the run it speaks for
    created_at: float  # clock time


@dataclass(frozen=True, slots=True)
class TrajectoryState:
    """A planned trajectory's bookkeeping (not its record)."""

    trajectory_id: str  # unique within the job
    group_id: str  # GRPO group
    task_id: str  # the task it samples
    repetition: int  # 0..n-1 within the group
    status: TrajectoryStatus  # PENDING/RUNNING until finished
    attempts: int  # times started (a re-run after a crash counts again)
    seq: int | None  # delivery number once finished


@dataclass(frozen=True, slots=True)
class Finish:
    """What `finish` did."""

    seq: int  # the trajectory's delivery number
    duplicate: bool  # True: it was already finished; the first record was kept


@dataclass(frozen=True, slots=True)
class Delivery:
    """One finished trajectory as stored."""

    seq: int  # delivery number, 1-based, dense within the job
    trajectory_id: str  # its id
    record_json: str  # the trajectory record (treadle.store.record), one line of JSON

    def record(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.record_json)
        return value

    def trajectory(self) -> Trajectory:
        return loads_record(self.record_json)


@dataclass(frozen=True, slots=True)
class TakenGroup:
    """A GRPO group of a continuous job, as handed out to its trainer."""

    taken: int  # its take number: 1, 2, 3, ... dense within the job
    group_id: str
    size: int  # members
    stale: bool  # a member's oldest token was out of the job's bound (StaleChoice.FLAG)
    members: tuple[Delivery, ...]  # its current members, by repetition


@dataclass(frozen=True, slots=True)
class Event:
    """One diagnostic event."""

    event_id: int  # increasing across the store
    job_id: str  # the job it concerns
    trajectory_id: str | None  # the trajectory, if it concerns one
    kind: str  # e.g. "job_created", "duplicate_finish", or the caller's own
    payload: dict[str, Any]  # JSON object
    at: float  # clock time

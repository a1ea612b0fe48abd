"""Persistence of jobs and trajectories (SQLite) and their export (JSONL, Parquet).

`Store` is the synchronous store, `AsyncStore` runs it on one worker thread for
asyncio code (or, `treadle.store.process.StoreProcess`, in a process of its own);
`trajectory_to_record`/`trajectory_from_record` are the JSON record,
the one wire shape of a trajectory. See docs/store.md.
"""

from treadle.store.aio import AsyncStore
from treadle.store.db import Store
from treadle.store.errors import NotFound, RecordError, SchemaError, StoreConflict, StoreError
from treadle.store.jobs import (
    Delivery,
    Event,
    Finish,
    JobInfo,
    JobStatus,
    PlannedTrajectory,
    TrainerKey,
    TrajectoryState,
)
from treadle.store.journal import Journaled, JournalRow
from treadle.store.record import (
    RECORD_VERSION,
    dumps_record,
    loads_record,
    trajectory_from_record,
    trajectory_to_record,
)

__all__ = [
    "RECORD_VERSION",
    "AsyncStore",
    "Delivery",
    "Event",
    "Finish",
    "JobInfo",
    "JobStatus",
    "JournalRow",
    "Journaled",
    "NotFound",
    "PlannedTrajectory",
    "RecordError",
    "SchemaError",
    "Store",
    "StoreConflict",
    "StoreError",
    "TrainerKey",
    "TrajectoryState",
    "dumps_record",
    "loads_record",
    "trajectory_from_record",
    "trajectory_to_record",
]

"""Run by test_store_crash.py: work through a job in a store file until killed.

    python store_crash_child.py DB JOB [HOLD_AFTER]

Creates JOB (50 groups of 16) if the file lacks it, then starts and finishes every
unfinished trajectory, printing "seq trajectory_id" after each finish commits. The
records are a function of the trajectory id, so the parent can check them. With
HOLD_AFTER = n, after n finishes it starts one more trajectory, prints "running
trajectory_id" once that start has committed and waits to be killed: the kill then
lands with that trajectory in flight.
"""

from __future__ import annotations

import random
import signal
import sys

from store_helpers import plan, random_trajectory

from treadle.store import NotFound, PlannedTrajectory, Store
from treadle.types import Trajectory, TrajectoryStatus


def result_for(p: PlannedTrajectory) -> Trajectory:
    return random_trajectory(random.Random(p.trajectory_id), p, TrajectoryStatus.COMPLETED)


def main(path: str, job: str, hold_after: str | None = None) -> None:
    store = Store(path)
    try:
        store.job(job)
    except NotFound:
        store.create_job(job, {"groups": 50, "n": 16}, plan(50, 16, job))
    store.recover()
    finished = 0
    for s in store.unfinished(job):
        p = PlannedTrajectory(s.trajectory_id, s.group_id, s.task_id, s.repetition)
        if store.start(job, s.trajectory_id) is None:
            continue
        if hold_after is not None and finished == int(hold_after):
            print("running", s.trajectory_id, flush=True)
            signal.pause()  # until the parent's SIGKILL
        result = store.finish(job, result_for(p))
        finished += 1
        print(result.seq, s.trajectory_id, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

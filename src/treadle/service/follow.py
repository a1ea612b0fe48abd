"""Following a job's results, and the records of trajectories that end without
running (the job runner's; `service.jobs`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from treadle.service.wakeups import JobWakeups
from treadle.store.aio import AsyncStore
from treadle.store.jobs import Delivery, PlannedTrajectory, TrajectoryState
from treadle.types import FailureStage, GroupKey, Trajectory, TrajectoryStatus


async def follow_results(store: AsyncStore, wakeups: JobWakeups, job_id: str, after: int,
                         *, follow: bool, heartbeat_s: float
                         ) -> AsyncIterator[Delivery | None]:
    """`Rollouts.results`: results with seq > `after`, with `follow` until the job
    ends, None after every `heartbeat_s` without one."""
    while True:
        # Taken before the read: a result stored after it wakes this follower.
        changed = wakeups.future(job_id)
        try:
            async for delivery in store.iter_results(job_id, after, 256):
                yield delivery
                after = delivery.seq
            info = await store.job(job_id)
            if not follow or (info.status.terminal and info.delivered <= after):
                return
            # asyncio.wait, not wait_for: a cancelled follower never cancels the
            # future its job's other followers share. Its timeout is also a
            # backstop: the store is read again after every heartbeat.
            done, _ = await asyncio.wait({changed}, timeout=heartbeat_s)
        finally:
            wakeups.leave(job_id, changed)
        if not done:
            yield None


def not_started(p: PlannedTrajectory, why: str) -> Trajectory:
    """A planned trajectory ended before it started, for an engine reason `why`."""
    return Trajectory(p.trajectory_id, GroupKey(p.group_id, p.repetition), task_id=p.task_id,
                      status=TrajectoryStatus.ERROR, failure_stage=FailureStage.ENGINE,
                      reason=f"engine: not started: {why}")


def interrupted(state: TrajectoryState) -> Trajectory:
    """A harness session's trajectory that died with the process."""
    return Trajectory(state.trajectory_id, GroupKey(state.group_id, state.repetition),
                      task_id=state.task_id, status=TrajectoryStatus.ERROR,
                      failure_stage=FailureStage.RUNTIME, attempt=state.attempts,
                      reason="runtime: the service restarted during the session")

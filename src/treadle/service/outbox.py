"""Where finished trajectories go: the store, once each, counted, their followers woken.

    outbox = Outbox(store, metrics)
    await outbox.deliver(job_id, trajectory)     # the job runner's and the gateway's

Both the job runner (`service.jobs.Rollouts`) and the gateway (`service.gateway`)
finish trajectories; each is given this one outbox when it is made, so neither
reaches into the other. A trajectory stored twice (a duplicate after a crash)
keeps its first delivery and is neither counted nor announced again.
"""

from __future__ import annotations

from treadle.service.metrics import Metrics
from treadle.service.wakeups import JobWakeups
from treadle.store.aio import AsyncStore
from treadle.types import Trajectory


class Outbox:
    """Delivers finished trajectories (module docstring)."""

    def __init__(self, store: AsyncStore, metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self.wakeups = JobWakeups()  # followers of a job, woken by its results

    async def deliver(self, job_id: str, traj: Trajectory) -> None:
        """Store a finished trajectory (a duplicate is dropped), count it, and wake the
        job's followers."""
        finish = await self.store.finish(job_id, traj)
        if finish.duplicate:
            return
        m = self.metrics
        m.finished[traj.status.value] += 1
        if traj.failure_stage is not None:
            m.failures[traj.failure_stage.value] += 1
        m.tokens += traj.output_tokens
        for turn in traj.turns:
            if turn.tool_call is not None:
                m.tool_latency.observe(turn.tool_call.latency_s)
        self.wakeups.wake(job_id)


__all__ = ["Outbox"]

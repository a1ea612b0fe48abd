"""`JobRecords`: what the service shows of one job's trajectories — its timeline
(the HTML page `treadle run` writes, drawn now), its GRPO groups with their
rewards, and one trajectory's record summed up.

Each finished trajectory is read from the store and parsed once: a job's rows
(`page.trajectories.TrajectoryRow`, with its group; not its tokens) are kept for
the `keep_jobs` jobs looked at last, and each later look reads only the results
delivered since (results never change once stored). Parsing runs on a worker
thread, not the event loop. A job's trajectories still running are drawn from
when they started to now (`Rollouts.running_since`, the runtime's clock, the one
the records' times are on).

Costs: the first look at a job parses every record it has (for a job of 65,536
long trajectories, seconds of a worker thread); a look at its groups reads every
trajectory's state (a row each, no record). The dashboard asks for the job a
person selected only.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from treadle.page.trajectories import (
    Tally,
    TrajectoryRow,
    render_report,
    running_row,
    summary_rows,
    trajectory_row,
)
from treadle.service.jobs import Rollouts
from treadle.service.views import (
    GroupView,
    JobGroups,
    SegmentView,
    TrajectoryDetail,
    TurnView,
)
from treadle.store.aio import AsyncStore
from treadle.store.errors import NotFound
from treadle.store.jobs import Delivery
from treadle.types import Trajectory


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished trajectory as the views need it."""

    row: TrajectoryRow
    group_id: str
    repetition: int


@dataclass(slots=True)
class _Digest:
    """One job's finished trajectories read so far."""

    after: int = 0  # the last seq read
    rows: dict[str, Finished] = field(default_factory=dict)  # by trajectory id
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class JobRecords:
    """See the module docstring."""

    def __init__(self, store: AsyncStore, rollouts: Rollouts, *, keep_jobs: int = 4,
                 page: int = 256) -> None:
        if keep_jobs < 1 or page < 1:
            raise ValueError("keep_jobs and page must be >= 1")
        self.store = store
        self.rollouts = rollouts
        self.keep_jobs = keep_jobs
        self.page = page
        self._digests: OrderedDict[str, _Digest] = OrderedDict()

    async def finished(self, job_id: str) -> dict[str, Finished]:
        """The job's finished trajectories by id (NotFound for an unknown job)."""
        digest = self._digests.pop(job_id, None) or _Digest()
        self._digests[job_id] = digest
        while len(self._digests) > self.keep_jobs:
            self._digests.popitem(last=False)
        async with digest.lock:
            while True:
                page = await self.store.results(job_id, digest.after, self.page)
                for done in await asyncio.to_thread(_parse, page):
                    digest.rows[done.row.trajectory_id] = done
                if page:
                    digest.after = page[-1].seq
                if len(page) < self.page:
                    return dict(digest.rows)

    async def timeline(self, job_id: str) -> str:
        """The job's timeline page now: finished rows, and running ones up to now."""
        info = await self.store.job(job_id)
        finished = await self.finished(job_id)
        running, queued = self.rollouts.here(job_id)
        now = self.rollouts.runtime.clock.now()
        rows = [f.row for f in finished.values()]
        rows += [running_row(tid, at, now) for tid, at
                 in self.rollouts.running_since(job_id).items() if tid not in finished]
        tally = Tally()
        for done in finished.values():
            tally.add(done.row)
        facts = [f"job {job_id} · {info.status.value} · {info.delivered} of {info.planned} "
                 f"finished, {running} running, {queued} queued here",
                 f"drawn at {now:.1f} s of the service's clock: a running trajectory's row "
                 "ends there"]
        return await asyncio.to_thread(render_report, rows, title=f"job {job_id}",
                                       summary=summary_rows(tally), facts=facts)

    async def groups(self, job_id: str, limit: int) -> JobGroups:
        """The job's first `limit` GRPO groups, in plan order, with their rewards."""
        states = await self.store.states(job_id)
        finished = await self.finished(job_id)
        by_group: dict[str, list[tuple[int, str, str]]] = {}
        tasks: dict[str, str] = {}
        for s in states:
            by_group.setdefault(s.group_id, []).append(
                (s.repetition, s.trajectory_id, s.status.value))
            tasks.setdefault(s.group_id, s.task_id)
        groups = []
        for group_id, members in list(by_group.items())[:limit]:
            members.sort()
            done = [finished.get(tid) for _, tid, _ in members]
            rewards = [None if f is None else f.row.reward for f in done]
            scored = [r for r in rewards if r is not None]
            groups.append(GroupView(
                group_id=group_id, task_id=tasks[group_id],
                statuses=[status for _, _, status in members], rewards=rewards,
                trajectory_ids=[tid for _, tid, _ in members],
                finished=sum(f is not None for f in done),
                mean_reward=math.fsum(scored) / len(scored) if scored else None,
                reward_spread=max(scored) - min(scored) if scored else None))
        return JobGroups(job_id=job_id, total=len(by_group), groups=groups)

    async def detail(self, job_id: str, trajectory_id: str) -> TrajectoryDetail:
        """One finished trajectory's record without its tokens; NotFound for one the
        job does not have, or that has not finished."""
        delivery = await self.store.result(job_id, trajectory_id)
        if delivery is None:
            raise NotFound(f"trajectory {trajectory_id!r} of job {job_id!r} has not finished")
        return _detail(job_id, delivery.seq, await asyncio.to_thread(delivery.trajectory))


def _parse(page: Sequence[Delivery]) -> list[Finished]:
    out = []
    for delivery in page:
        t = delivery.trajectory()
        out.append(Finished(trajectory_row(t), t.key.group_id, t.key.repetition))
    return out


def _detail(job_id: str, seq: int, t: Trajectory) -> TrajectoryDetail:
    turns = [TurnView(index=turn.index, output_tokens=turn.output_tokens,
                      engine_id=turn.engine_id, policy_version=turn.policy_version,
                      queued_s=turn.queued_s, generating_s=turn.generating_s,
                      tool=None if turn.tool_call is None else turn.tool_call.name,
                      tool_latency_s=None if turn.tool_call is None else turn.tool_call.latency_s,
                      tool_error=None if turn.tool_call is None else turn.tool_call.error)
             for turn in t.turns]
    segments = [SegmentView(start_turn=s.start_turn, start_reason=s.start_reason,
                            prompt_tokens=len(s.prompt_ids), response_tokens=len(s.response_ids),
                            sampled_tokens=sum(s.loss_mask),
                            policy_versions=list(dict.fromkeys(s.policy_versions)))
                for s in t.segments]
    return TrajectoryDetail(
        job_id=job_id, seq=seq, trajectory_id=t.trajectory_id, group_id=t.key.group_id,
        repetition=t.key.repetition, task_id=t.task_id, status=t.status.value,
        reason=t.reason, reward=t.reward,
        reward_source=None if t.reward_source is None else t.reward_source.value,
        attempt=t.attempt, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
        policy_versions=list(dict.fromkeys(turn.policy_version for turn in t.turns)),
        llm_s=t.timings.llm_s, tool_s=t.timings.tool_s, queue_s=t.timings.queue_s,
        started_at=t.timings.started_at, finished_at=t.timings.finished_at,
        turns=turns, segments=segments)


__all__ = ["Finished", "JobRecords"]

"""Continuous jobs: GRPO groups launched as the trainer takes finished ones.

A continuous job (`JobRequest.continuous`) is planned lazily: its task source (a
suite's tasks, a generated workload or a trace) is resolved once by the `Planner`
into one epoch of groups (`TaskSource`), and group k is the source's group at
position k mod N of epoch k div N, the epochs' orders drawn from the source's seed
and the epoch. A group is stored (`Store.launch_group`) and queued on the job runner
(`Rollouts.enqueue`) when it is launched; `ContinuousJobs` keeps
ceil(in_flight * (1 + overprovision)) groups launched and not taken, until the
budget (groups in all) is launched, and the job completes once every group of it
has been run. Memory: the source, and the job runner's queued and running work;
taken groups live in the store (`Store.taken_groups` reads them back).

The trainer takes groups (`take`): the first complete ones, oldest-ready first, each
once (`treadle.store.continuous`: a take number per group, and the caller's id of
the take call, which makes a repeated call return the same groups). A take waits
for its groups up to `wait_s`.

The staleness bound (`ContinuousParams.max_staleness`, S): with the engines serving
version V, a trajectory whose oldest sampled token is older than V - S is out of it.
On every weight update and every finished trajectory, each job's runner looks again
(`_sweep`): with `restart` (and with `cut`, a member that cannot be cut) it stops
members running since a version out of the bound and runs them again from their
prompts, and restarts finished members out of it in groups not taken; their tokens
are counted as discarded (`treadle_tokens_discarded_total`, and a `stale_restart`
event per member with the served version). A running trajectory's oldest token is
taken to be the version served when it started (a lower bound). `take` checks the
bound again when it hands a group out, so a group is never handed out as fresh out
of the bound, whenever the restarts get done.

Restart safety: everything is in the store. After a restart, each unfinished
continuous job is resolved again (the same source, the same epochs), its unfinished
members queued again (groups in flight are re-run) and its launching resumed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import uuid
from dataclasses import dataclass, field

from treadle.errors import ServiceBusy, TreadleError
from treadle.service.continuous_schemas import ContinuousParams
from treadle.service.errors import RequestRefused
from treadle.service.jobs import Rollouts, window
from treadle.service.planning import Work
from treadle.service.schemas import MAX_TRAJECTORIES_PER_JOB, JobRequest, SessionTasks
from treadle.service.versions import PolicyMismatch
from treadle.store.jobs import JobInfo, PlannedTrajectory, TakenGroup
from treadle.store.staleness import cut_record
from treadle.types import StaleChoice

log = logging.getLogger(__name__)


class TaskSource:
    """A continuous job's groups, cycled in seeded epochs (module docstring).
    `templates`: one epoch's groups as the planner resolved them, each its members'
    work in repetition order."""

    def __init__(self, job_id: str, seed: int, templates: list[list[Work]]) -> None:
        if not templates:
            raise ValueError("a continuous job needs at least one task")
        self.job_id = job_id
        self.seed = seed
        self.templates = templates
        prefix = f"{job_id}/"
        self.keys = [t[0].planned.group_id.removeprefix(prefix) for t in templates]
        self._index = {k: i for i, k in enumerate(self.keys)}
        self._epoch = -1
        self._order: list[int] = []

    def _position(self, epoch: int, i: int) -> int:
        if epoch != self._epoch:  # one epoch's order at a time: planned when needed
            self._order = list(range(len(self.templates)))
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order[i]

    def group(self, k: int) -> tuple[str, list[Work]]:
        """Group k of the job's stream: its id and its members' work."""
        epoch, i = divmod(k, len(self.templates))
        index = self._position(epoch, i)
        group_id = f"{self.job_id}/e{epoch}/{self.keys[index]}"
        return group_id, [self.work(PlannedTrajectory(
            f"{group_id}/{w.planned.repetition}", group_id, w.planned.task_id,
            w.planned.repetition)) for w in self.templates[index]]

    def work(self, planned: PlannedTrajectory) -> Work:
        """What to run for a member of one of the job's groups (a launch, a restart,
        a recovery)."""
        key = planned.group_id.removeprefix(f"{self.job_id}/e").partition("/")[2]
        template = self.templates[self._index[key]][planned.repetition]
        return dataclasses.replace(template, planned=planned)

    @staticmethod
    def restarted(planned: PlannedTrajectory) -> PlannedTrajectory:
        """The member that runs again in `planned`'s place (a new id)."""
        base, _, attempt = planned.trajectory_id.partition("~")
        return dataclasses.replace(planned, trajectory_id=f"{base}~{int(attempt or 0) + 1}")


@dataclass(slots=True)
class _Cont:
    request: JobRequest
    params: ContinuousParams
    source: TaskSource
    choice: StaleChoice
    restarting: set[str] = field(default_factory=set)  # members being restarted
    driver: asyncio.Task[None] | None = None


class ContinuousJobs:
    """Runs continuous jobs on a `Rollouts`; see the module docstring."""

    def __init__(self, rollouts: Rollouts) -> None:
        self.rollouts = rollouts
        self.store = rollouts.store
        self._wakeups = rollouts.outbox.wakeups
        self._jobs: dict[str, _Cont] = {}

    async def submit(self, request: JobRequest, *, owner: str | None = None) -> JobInfo:
        """Store a continuous job and start launching its groups; RequestRefused for
        a source that cannot run here or more trajectories at once than a job may
        plan, ServiceBusy if the queue cannot take them, PolicyMismatch for another
        run's weights."""
        job_id = request.job_id or uuid.uuid4().hex[:16]
        verdict = window(request).verdict(self.rollouts.served())
        if verdict not in ("run", "wait"):
            raise PolicyMismatch(f"job {job_id}: {verdict}")
        source = await asyncio.to_thread(self._source, job_id, request)
        assert request.continuous is not None
        live = request.continuous.live_groups * max(len(t) for t in source.templates)
        if live > MAX_TRAJECTORIES_PER_JOB:
            raise RequestRefused(f"continuous.in_flight: {live} trajectories launched at "
                                 f"once is over the {MAX_TRAJECTORIES_PER_JOB} a job may have")
        if self.rollouts.queued + live > self.rollouts.max_queued:
            raise ServiceBusy(f"{self.rollouts.queued} trajectories are queued here and the "
                              f"job adds up to {live}, over the limit of "
                              f"{self.rollouts.max_queued}; retry later")
        info = await self.store.create_job(job_id, {"request": request.model_dump(
            mode="json")}, [], owner=owner, continuous=True)
        self._run(job_id, request, source)
        return info

    async def start(self) -> list[str]:
        """After `Rollouts.start` (the store recovered): resume every unfinished
        continuous job. A job whose source can no longer be resolved is failed."""
        resumed = []
        for info in await self.store.unfinished_jobs():
            spec = await self.store.job_spec(info.job_id)
            request = JobRequest.model_validate(spec["request"])
            if request.continuous is None:
                continue
            try:
                source = await asyncio.to_thread(self._source, info.job_id, request)
            except (TreadleError, ValueError, KeyError) as e:
                await self.store.fail(info.job_id, f"cannot resume after a restart: {e}")
                continue
            pending = await self.store.unfinished(info.job_id)
            self.rollouts.enqueue(info.job_id, request, [source.work(PlannedTrajectory(
                s.trajectory_id, s.group_id, s.task_id, s.repetition)) for s in pending])
            self._run(info.job_id, request, source)
            resumed.append(info.job_id)
        return resumed

    async def close(self) -> None:
        drivers = [job.driver for job in self._jobs.values() if job.driver is not None]
        for task in drivers:
            task.cancel()
        await asyncio.gather(*drivers, return_exceptions=True)

    def policy_version_changed(self) -> None:
        """After a weight update: every job looks at its staleness again."""
        for job_id in self._jobs:
            self._wakeups.wake(job_id)

    async def take(self, job_id: str, take_id: str, n: int,
                   wait_s: float) -> tuple[list[TakenGroup], int, bool]:
        """Up to `n` groups for take call `take_id` (the same call again: the same
        groups), waiting up to `wait_s` for them; (the groups, groups taken so far,
        whether the job has ended with nothing more to take). NotFound for an
        unknown job, RequestRefused for a job that is not continuous."""
        params = await self._params(job_id)
        choice = StaleChoice(params.on_stale)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        out: list[TakenGroup] = []
        while True:
            changed = self._wakeups.future(job_id)
            try:
                terminal = (await self.store.job(job_id)).status.terminal
                min_fresh = (None if params.max_staleness is None else
                             self.rollouts.runtime.policy_version - params.max_staleness)
                had = len(out)
                out = await self.store.take(job_id, take_id, n, min_fresh, choice)
                if len(out) > had:
                    self._wakeups.wake(job_id)  # slots freed: its runner launches more
                left = deadline - loop.time()
                if len(out) == n or terminal or left <= 0:
                    break
                await asyncio.wait({changed}, timeout=left)
            finally:
                self._wakeups.leave(job_id, changed)
        taken = (await self.store.groups_launched(job_id))[1]
        return out, taken, terminal and len(out) < n

    async def groups_taken(self, job_id: str) -> int | None:
        """Groups of a continuous job handed out so far; None for another job."""
        launched, taken, _ = await self.store.groups_launched(job_id)
        return taken if launched or job_id in self._jobs else None

    async def _params(self, job_id: str) -> ContinuousParams:
        job = self._jobs.get(job_id)
        if job is not None:
            return job.params
        request = JobRequest.model_validate((await self.store.job_spec(job_id))["request"])
        if request.continuous is None:
            raise RequestRefused(f"job_id: job {job_id!r} is not a continuous job: read "
                                 "its trajectories or groups instead")
        return request.continuous

    def _source(self, job_id: str, request: JobRequest) -> TaskSource:
        """One epoch, resolved as a job of the same tasks would be (the same checks)."""
        work = self.rollouts.planner.resolve(job_id, request)
        groups: dict[str, list[Work]] = {}
        for w in work:
            groups.setdefault(w.planned.group_id, []).append(w)
        tasks = request.tasks
        seed = 0 if isinstance(tasks, SessionTasks) else tasks.seed  # (refused: sessions)
        return TaskSource(job_id, seed, list(groups.values()))

    def _run(self, job_id: str, request: JobRequest, source: TaskSource) -> None:
        assert request.continuous is not None
        job = _Cont(request, request.continuous, source, StaleChoice(request.continuous.on_stale))
        self._jobs[job_id] = job
        job.driver = asyncio.get_running_loop().create_task(self._drive(job_id, job))

    async def _drive(self, job_id: str, job: _Cont) -> None:
        """Launch groups and keep the bound until the job ends; woken by its results,
        its takes and weight updates."""
        try:
            while True:
                changed = self._wakeups.future(job_id)
                try:
                    if (await self.store.job(job_id)).status.terminal:
                        return
                    await self._sweep(job_id, job)
                    await self._launch(job_id, job)
                    await asyncio.wait({changed}, timeout=30.0)  # (a backstop)
                finally:
                    self._wakeups.leave(job_id, changed)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("continuous job %s stopped launching", job_id)
        finally:
            self._jobs.pop(job_id, None)

    async def _launch(self, job_id: str, job: _Cont) -> None:
        launched, _, live = await self.store.groups_launched(job_id)
        budget = job.params.budget
        while live < job.params.live_groups and (budget is None or launched < budget):
            group_id, work = job.source.group(launched)
            launched += 1
            await self.store.launch_group(job_id, group_id, [w.planned for w in work],
                                          close=launched == budget)
            self.rollouts.enqueue(job_id, job.request, work)
            live += 1

    async def _sweep(self, job_id: str, job: _Cont) -> None:
        """Restart what is out of the bound (module docstring)."""
        bound = job.params.max_staleness
        if bound is None or job.choice is StaleChoice.FLAG:
            return
        served = self.rollouts.runtime.policy_version
        min_fresh = served - bound
        if min_fresh <= 0:
            return
        if job.choice is StaleChoice.RESTART:
            for tid, version in self.rollouts.running_versions(job_id).items():
                if version < min_fresh:
                    state = await self.store.trajectory_state(job_id, tid)
                    await self._restart(job_id, job, PlannedTrajectory(
                        tid, state.group_id, state.task_id, state.repetition), served,
                        running=True)
        for delivery, _ in await self.store.stale_members(job_id, min_fresh):
            if job.choice is StaleChoice.CUT and \
                    cut_record(delivery.record_json, min_fresh) is not None:
                continue  # cut when it is taken
            t = delivery.trajectory()
            await self._restart(job_id, job, PlannedTrajectory(
                t.trajectory_id, t.key.group_id, t.task_id, t.key.repetition), served,
                running=False)

    async def _restart(self, job_id: str, job: _Cont, old: PlannedTrajectory, served: int,
                       *, running: bool) -> None:
        if old.trajectory_id in job.restarting:
            return
        job.restarting.add(old.trajectory_id)
        try:
            sampled = 0
            if running:
                sampled = self.rollouts.runtime.sampled_tokens(old.trajectory_id)
                task = self.rollouts.stop(job_id, old.trajectory_id)
                if task is not None:
                    await asyncio.gather(task, return_exceptions=True)
            new = TaskSource.restarted(old)
            discarded = await self.store.restart(
                job_id, old.trajectory_id, new, served, sampled=sampled,
                reason=f"stale: restarted at policy version {served}")
            if discarded is None:
                return
            self._wakeups.wake(job_id)  # its stream has the old one's end
            self.rollouts.metrics.tokens_discarded += discarded
            self.rollouts.enqueue(job_id, job.request, [job.source.work(new)])
        finally:
            job.restarting.discard(old.trajectory_id)


__all__ = ["ContinuousJobs", "TaskSource"]

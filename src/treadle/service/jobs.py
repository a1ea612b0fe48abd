"""Jobs: a trainer's batch of tasks, run as trajectories on the runtime, kept in the store.

`Rollouts` is what the HTTP app calls. A job is planned when it is submitted
(`planning.Planner`: every trajectory gets its id, GRPO group and repetition, and
what to run) and stored with its request in one transaction; then its trajectories
wait in one queue for the process's slots (`max_live`), highest job priority first,
then oldest job, then plan order. A started trajectory is marked in the store (its
attempt counted), runs (`service.attempts`: sandbox, agent loop, reward, its rubric's
judges; or a workload replay; its turns journaled) and is stored with the next
delivery number of its job, which is the order the NDJSON stream hands results out in.

Restart: `start()` asks the store to recover — trajectories that were running when
the process died go back to pending — and queues every unfinished trajectory of
every unfinished job again; their attempt count goes up, and each resumes from its
last journaled turn (`service.journal`). A result stored twice (a
duplicate after a crash) keeps its first delivery, so nothing is delivered twice.
Results live in the store, not here: memory holds only the queued and running work.

Limits: a job plans at most `MAX_TRAJECTORIES_PER_JOB` trajectories (tasks times
samples); a replayed trace line may not need more context than `max_context` (the
served model's window: the replay builds that many synthetic ids); a job that would
queue more than `max_queued` trajectories in this process is refused with
`ServiceBusy`, which bounds the memory of queued work. Planning (generating a
workload, parsing tasks) runs on a worker thread, not the event loop, so a large
job's submission does not stall the trajectories already running.

Cancel: unfinished trajectories are stored as aborted (and delivered), queued ones
dropped, running ones cancelled. `service.continuous` queues a continuous job's groups.

Policy versions (`service.versions`): a job's trajectories start only once the
runtime's policy version has reached `min_policy_version` (set by a weight update),
so a trainer may submit the next step's job before its weights are live. A job whose
window the served weights are past (`max_policy_version`), or another trainer run's
(`trainer_run`), is refused with PolicyMismatch; when a weight update moves the
engines out of a job's window, its trajectories not started yet end as engine
failures (excluded) with the reason.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.errors import ServiceBusy, TreadleError
from treadle.runtime.driver import Runtime
from treadle.service.attempts import Attempts, HarnessRunner
from treadle.service.errors import RequestRefused
from treadle.service.follow import follow_results, interrupted, not_started
from treadle.service.metrics import Metrics
from treadle.service.outbox import Outbox
from treadle.service.planning import (
    HarnessWork,
    Planner,
    SuiteWork,
    Work,
    planned_sessions,
)
from treadle.service.schemas import (
    JobRequest,
    RolloutRequest,
    SessionTasks,
    SuiteTasks,
)
from treadle.service.versions import PolicyMismatch, PolicyWindow, ServedPolicy
from treadle.store.aio import AsyncStore
from treadle.store.errors import NotFound
from treadle.store.jobs import Delivery, JobInfo, TrajectoryState
from treadle.types import Trajectory

log = logging.getLogger(__name__)
POLICY_WINDOW = "policy_window"  # the event kind of a job's window (when not the default)
TRAINER_METRICS = "trainer_metrics"  # the event kind of a trainer's reports
MAX_TRAINER_METRICS = 256  # names a job keeps (each GET of the job merges them)
# Trajectories next to start whose sandbox images are opened ahead (unpacking one
# takes seconds to minutes; a few ahead covers the slots that free up meanwhile).
PREWARM_AHEAD = 4


@dataclass(slots=True)
class _Job:
    """What this process keeps of an unfinished job."""

    priority: int
    order: int  # submission order (ties of priority: oldest first)
    window: PolicyWindow  # the weights its trajectories may be sampled from
    queue: collections.deque[Work]  # its trajectories not started yet, in plan order
    running: dict[str, asyncio.Task[None]]  # trajectory id -> its task
    # trajectory id -> when it started (the runtime's clock, as its record's times)
    started: dict[str, float] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # -> policy version served then

    @property
    def queued(self) -> int:
        return len(self.queue)


class Rollouts:
    """Runs jobs on one `Runtime`, stores them in one store. See the module docstring.

    `planner` resolves requests; `outbox` stores what finishes; `attempts` runs each
    start of a trajectory (`service.attempts`); `harnesses` hears of cancelled harness
    jobs (None: the service runs none)."""

    def __init__(self, runtime: Runtime, store: AsyncStore, planner: Planner, outbox: Outbox,
                 attempts: Attempts, *, harnesses: HarnessRunner | None = None,
                 max_live: int = 4096, max_queued: int = 262_144) -> None:
        self.runtime = runtime
        self.store = store
        self.planner = planner
        self.outbox = outbox
        self.attempts = attempts
        self.harnesses = harnesses
        self.max_live = max_live  # trajectories running at once in this process
        self.max_queued = max_queued  # trajectories waiting for a slot, all jobs together
        self._jobs: dict[str, _Job] = {}
        # Jobs with work to start, highest priority then oldest first. An entry goes
        # stale when its job is cancelled; _dispatch drops it (one entry per job).
        self._ready: list[tuple[int, int, str]] = []  # heap of (-priority, order, job id)
        self._waiting: dict[str, _Job] = {}  # jobs whose policy version is not live yet
        self._order = itertools.count()
        self._live = 0
        self._wakeups = outbox.wakeups
        self._tasks: set[asyncio.Task[None]] = set()  # deliveries of dropped work
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> list[str]:
        """Recover the store's unfinished jobs and queue their trajectories again;
        returns their ids. A job whose request can no longer be resolved is failed."""
        self.attempts.start()
        recovered = []
        for info in await self.store.recover():
            try:
                spec = await self.store.job_spec(info.job_id)
                request = JobRequest.model_validate(spec["request"])
                if request.continuous is not None:
                    continue  # resumed by its own runner (service.continuous)
                if isinstance(request.tasks, SessionTasks):
                    # The sessions that were open are opened again from their journals
                    # (their harnesses continue); those that cannot be end as errors.
                    # Untaken ones stay pending.
                    started = [s for s in await self.store.unfinished(info.job_id)
                               if s.attempts]
                    await self._interrupted(info.job_id, started if self.harnesses is None
                                            else await self.harnesses.restore(info.job_id,
                                                                              started))
                    recovered.append(info.job_id)
                    continue
                # Planning can be long (a suite's tasks, a big trace): off the loop,
                # where the jobs recovered before this one are already running.
                work = await asyncio.to_thread(self.planner.resolve, info.job_id, request)
            except (TreadleError, ValueError, KeyError) as e:
                await self.store.fail(info.job_id,
                                      f"cannot resume after a restart: {e}")
                continue
            unfinished = await self.store.unfinished(info.job_id)
            pending = {s.trajectory_id for s in unfinished}
            # Trajectories the plan does not make again (a harness run's sub-agent
            # sessions, added while it ran) died with the process: their job must end.
            planned = {w.planned.trajectory_id for w in work}
            await self._interrupted(info.job_id, [s for s in unfinished
                                                  if s.trajectory_id not in planned])
            self.enqueue(info.job_id, request, [w for w in work
                                                   if w.planned.trajectory_id in pending])
            recovered.append(info.job_id)
        return recovered

    async def close(self) -> None:
        """Cancel running trajectories (they stay unfinished in the store, to be
        resumed by the next start) and close the sandbox pools."""
        self._closed = True
        tasks = [t for job in self._jobs.values() for t in job.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Dropped work's deliveries finish: they are results, not work to resume.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.attempts.close()

    # -- jobs ---------------------------------------------------------------------------

    async def submit(self, request: JobRequest, *, owner: str | None = None) -> JobInfo:
        """Plan, store and queue a job owned by trainer run `owner` (None: the
        admin's); RequestRefused for what cannot run here, ServiceBusy if the queue
        is full, StoreConflict if `job_id` is taken."""
        job_id = request.job_id or uuid.uuid4().hex[:16]
        self.planner.check_rubric(request)
        if isinstance(request.tasks, SessionTasks):
            # Nothing to run here: harnesses take the sessions (service.gateway).
            planned = planned_sessions(job_id, request.tasks, request.samples_per_task)
            return await self.store.create_job(job_id, {"request": request.model_dump(
                mode="json")}, planned, owner=owner)
        verdict = window(request).verdict(self.served())
        if verdict not in ("run", "wait"):
            raise PolicyMismatch(f"job {job_id}: {verdict}")
        work, stored = await asyncio.to_thread(
            lambda: (self.planner.resolve(job_id, request), request.model_dump(mode="json")))
        if self.queued + len(work) > self.max_queued:
            raise ServiceBusy(f"{self.queued} trajectories are queued here and the job adds "
                              f"{len(work)}, over the limit of {self.max_queued}; retry later")
        info = await self.store.create_job(job_id,
                                     {"request": stored},
                                     [w.planned for w in work], owner=owner)
        if window(request) != PolicyWindow():
            # Read back by every status request: kept apart from the (large) spec.
            await self.store.add_event(job_id, POLICY_WINDOW, {
                "min_policy_version": request.min_policy_version,
                "max_policy_version": request.max_policy_version,
                "trainer_run": request.trainer_run})
        self.enqueue(job_id, request, work)
        return info

    async def cancel(self, job_id: str) -> JobInfo:
        info = await self.store.cancel(job_id)
        if self.harnesses is not None:
            self.harnesses.job_cancelled(job_id)
        job = self._jobs.pop(job_id, None)
        self._waiting.pop(job_id, None)
        if job is not None:
            job.queue.clear()
            for task in job.running.values():
                task.cancel()
        self._wakeups.wake(job_id)
        return info

    async def job(self, job_id: str) -> tuple[JobInfo, int, int]:
        """(the stored state, trajectories running here, queued here)."""
        return (await self.store.job(job_id), *self.here(job_id))

    def here(self, job_id: str) -> tuple[int, int]:
        """(the job's trajectories running here, queued here)."""
        job = self._jobs.get(job_id)
        return (len(job.running), job.queued) if job else (0, 0)

    def running_since(self, job_id: str | None = None) -> dict[str, float]:
        """The trajectories running here (of one job, or of all), each with when it
        started on the runtime's clock."""
        jobs = list(self._jobs.values()) if job_id is None else \
            [self._jobs[job_id]] if job_id in self._jobs else []
        return {tid: at for job in jobs for tid, at in job.started.items()}

    async def job_policy(self, job_id: str) -> tuple[dict[str, Any], dict[str, float]]:
        """The job's policy window (JobRequest's fields, those given) and what its
        trainer reported (`report`); NotFound for an unknown job."""
        merged = await self.store.merged_events(job_id, (POLICY_WINDOW, TRAINER_METRICS))
        return merged[POLICY_WINDOW], merged[TRAINER_METRICS]

    async def report(self, job_id: str, metrics: dict[str, float]) -> None:
        """Keep numbers a trainer measured on the job's data (latest per name);
        RequestRefused past `MAX_TRAINER_METRICS` names a job."""
        _, known = await self.job_policy(job_id)
        if len(known.keys() | metrics.keys()) > MAX_TRAINER_METRICS:
            raise RequestRefused(f"metrics: a job keeps at most {MAX_TRAINER_METRICS} "
                                 "names; report fewer")
        await self.store.add_event(job_id, TRAINER_METRICS, metrics)

    async def results(self, job_id: str, after: int = 0, *, follow: bool = False,
                      heartbeat_s: float = 15.0) -> AsyncIterator[Delivery | None]:
        """Results with seq > `after` in order; with `follow`, wait for more until the
        job ends, yielding None after every `heartbeat_s` without one (a stream writes
        a blank line then, so that its client can tell a silent job from a dead
        connection). NotFound for an unknown job."""
        async for delivery in follow_results(self.store, self._wakeups, job_id, after,
                                             follow=follow, heartbeat_s=heartbeat_s):
            yield delivery

    async def rollout(self, request: RolloutRequest, *,
                      owner: str | None = None) -> dict[str, Any]:
        """One trajectory, run now (as a one-trajectory job of trainer run `owner`, on
        its weights; None: the admin's, on any); its record."""
        job = JobRequest(tasks=SuiteTasks(suite=request.suite, tasks=[request.task],
                                          options=request.options),
                         sampling=request.sampling, limits=request.limits, priority=1000,
                         trainer_run=owner)
        info = await self.submit(job, owner=owner)
        try:
            async for delivery in self.results(info.job_id, follow=True):
                if delivery is not None:
                    return delivery.record()
        except asyncio.CancelledError:
            await self.cancel(info.job_id)
            raise
        raise RuntimeError(f"job {info.job_id} ended without a result")

    @property
    def metrics(self) -> Metrics:
        return self.outbox.metrics

    @property
    def live(self) -> int:
        return self._live

    @property
    def followed_jobs(self) -> int:
        """Jobs with followers waiting for their next result (0 when none is followed)."""
        return self._wakeups.jobs

    @property
    def queued(self) -> int:
        return sum(job.queued for job in self._jobs.values())

    def served(self) -> ServedPolicy:
        """What the policy's engines serve now."""
        return ServedPolicy(self.runtime.policy_version, self.runtime.trainer_run)

    def policy_version_changed(self) -> None:
        """Call after a weight update (or a resume): jobs whose window the served
        weights are in may start, jobs below it wait again, and jobs whose window the
        weights are out of end their queued trajectories."""
        served = self.served()
        for job_id, job in list(self._jobs.items()):
            verdict = job.window.verdict(served)
            if verdict == "run":
                if job_id in self._waiting:
                    del self._waiting[job_id]
                    heapq.heappush(self._ready, (-job.priority, job.order, job_id))
            elif verdict == "wait":
                # Back below its window (a new run restarting from version 0): its
                # heap entry goes stale, _dispatch skips jobs that wait.
                self._waiting[job_id] = job
            elif job.queue:
                self._drop_queued(job_id, job, verdict)
        self._dispatch()

    def _drop_queued(self, job_id: str, job: _Job, why: str) -> None:
        """End the job's trajectories not started yet as engine failures (`why`)."""
        self._waiting.pop(job_id, None)
        dropped = list(job.queue)
        job.queue.clear()
        if not job.running:
            del self._jobs[job_id]
        self._spawn(self._out_of_window(job_id, dropped, why))

    def running_versions(self, job_id: str) -> dict[str, int]:
        """The job's trajectories running here, each with the policy version served
        when it started (none of its tokens is older)."""
        job = self._jobs.get(job_id)
        return dict(job.versions) if job else {}

    def stop(self, job_id: str, trajectory_id: str) -> asyncio.Task[None] | None:
        """Cancel one running trajectory (it stays unfinished in the store); its task."""
        job = self._jobs.get(job_id)
        task = job.running.get(trajectory_id) if job else None
        if task is not None:
            task.cancel()
        return task

    def enqueue(self, job_id: str, request: JobRequest, work: list[Work]) -> None:
        """Queue a job's trajectories, already in the store (more of a job queued
        here: a continuous job's next group, a restart)."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.queue.extend(work)
            if job_id not in self._waiting:
                heapq.heappush(self._ready, (-job.priority, job.order, job_id))
            self._dispatch()
            return
        job = _Job(request.priority, next(self._order), window(request),
                   collections.deque(work), {})
        self._jobs[job_id] = job
        if not work:
            return
        verdict = job.window.verdict(self.served())
        if verdict not in ("run", "wait"):
            # The weights moved past its window while it was planned (or, after a
            # restart, before it resumed): nothing of it can run now.
            self._drop_queued(job_id, job, verdict)
        elif verdict == "wait":
            self._waiting[job_id] = job
        else:
            heapq.heappush(self._ready, (-job.priority, job.order, job_id))
        self._dispatch()

    # -- running ------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start queued trajectories while there are slots (and their version is live)."""
        while self._ready and self._live < self.max_live and not self._closed:
            job_id = self._ready[0][2]
            job = self._jobs.get(job_id)
            if job is None or not job.queue or job_id in self._waiting:
                heapq.heappop(self._ready)  # cancelled, all started, or waiting again
                continue
            if self.runtime.paused and job.window.bounded:
                # Weights are changing: a trajectory started now would sample on
                # whatever comes next, which may be outside its window. The resume
                # (policy_version_changed) looks at it again.
                heapq.heappop(self._ready)
                self._waiting[job_id] = job
                continue
            work = job.queue.popleft()
            self._live += 1
            task = asyncio.get_running_loop().create_task(self._run(work))
            # A callback, not a `finally` in _run: a task cancelled before its first
            # step (a cancel right after a dispatch) never runs its body's finally,
            # and its slot would be lost.
            task.add_done_callback(functools.partial(self._settled, work))
            job.running[work.planned.trajectory_id] = task
            job.started[work.planned.trajectory_id] = self.runtime.clock.now()
            job.versions[work.planned.trajectory_id] = self.runtime.policy_version
        self._prewarm()

    def _prewarm(self) -> None:
        """Open the sandbox images of the next `PREWARM_AHEAD` trajectories to start, in
        the order they will (`SuitePools.prepare`: each image once, in the background)."""
        ahead = (work for _, _, job_id in sorted(self._ready) if job_id in self._jobs
                 for work in self._jobs[job_id].queue)
        for work in itertools.islice(ahead, PREWARM_AHEAD):
            if isinstance(work, SuiteWork | HarnessWork):
                self.attempts.sandboxes.prepare(work.suite, work.task)

    async def _run(self, work: Work) -> None:
        tid = work.planned.trajectory_id
        try:
            attempt = await self.store.start(work.job_id, tid)
            if attempt is not None:
                traj = await self.attempts.run(work, attempt)
                await self.deliver(work.job_id, traj)
        except asyncio.CancelledError:
            raise
        except NotFound:
            pass  # the job was deleted meanwhile
        except Exception:  # a bug here must not stop the other trajectories
            log.exception("trajectory %s of job %s failed in the service", tid, work.job_id)

    def _settled(self, work: Work, _task: asyncio.Task[None]) -> None:
        """A trajectory's task is done, however: its slot is free."""
        self._live -= 1
        job = self._jobs.get(work.job_id)
        if job is not None:
            job.running.pop(work.planned.trajectory_id, None)
            job.started.pop(work.planned.trajectory_id, None)
            job.versions.pop(work.planned.trajectory_id, None)
            if not job.running and not job.queued:
                del self._jobs[work.job_id]
        self._dispatch()

    async def _out_of_window(self, job_id: str, work: Sequence[Work], why: str) -> None:
        for w in work:
            await self.deliver(job_id, not_started(w.planned, why))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _interrupted(self, job_id: str, states: Sequence[TrajectoryState]) -> None:
        for state in states:
            await self.deliver(job_id, interrupted(state))

    async def deliver(self, job_id: str, traj: Trajectory) -> None:
        """Store a finished trajectory (`Outbox.deliver`)."""
        await self.outbox.deliver(job_id, traj)


def window(request: JobRequest) -> PolicyWindow:
    """The weights a job is for, from its request."""
    return PolicyWindow(request.min_policy_version, request.max_policy_version,
                        request.trainer_run)


__all__ = ["Rollouts", "window"]

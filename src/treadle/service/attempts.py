"""One attempt of one planned trajectory: what runs it, journaled turn by turn.

`Attempts.run(work, attempt)` runs a job's trajectory once, by its kind of work: a
suite task (`runtime.rollout.run_task`: sandbox, agent loop, reward, then its
rubric's judges), a workload replay (`replay_task`), a harness run (the gateway's,
then its rubric's judges).
Suite tasks and replays journal their completed turns (`service.journal`), and an
attempt after a restart resumes from its last journaled turn; a harness run's
sessions are the gateway's and start over. It returns the trajectory (a failure
outside the agent loop is an error record, stage runtime) and raises only
CancelledError.

With runner actors (`runtime.ray_runners`), replays run in them, and suite tasks
too where the actors were given the tokenizer and sandboxes (`RayRunners.runs_tasks`;
a suite task's rubric is judged here, with the work tree its actor read). One whose
actor is lost runs again as a new attempt (counted in the store, resumed from its
journaled turns), on another actor, at most `runner_retries` times; after that its
record is an error, stage runtime, that says so. A harness run's sessions stay in
the service (the gateway's), their turns in the actors (`RayRunners.turns`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from treadle.agent.tokenizer import Tokenizer
from treadle.runtime.driver import Runtime
from treadle.runtime.ray_runners import RayRunners
from treadle.runtime.remote_trajectory import RunnerLost
from treadle.runtime.rollout import replay_task, run_task
from treadle.runtime.suite_pools import SuitePools
from treadle.service.journal import AttemptJournal, JournalWriter
from treadle.service.judging import Judging
from treadle.service.planning import HarnessWork, ReplayWork, SuiteWork, Work
from treadle.store.jobs import TrajectoryState
from treadle.types import FailureStage, GroupKey, Trajectory, TrajectoryStatus

log = logging.getLogger(__name__)


class HarnessRunner(Protocol):
    """Who runs a harness job's trajectories (the gateway), as the job runner sees it."""

    async def run_harness(self, work: HarnessWork, attempt: int) -> Trajectory:
        """One trajectory of a harness job, start to end; raises only CancelledError."""
        ...

    def job_cancelled(self, job_id: str) -> None:
        """The job was cancelled: its open sessions end now (stored already)."""
        ...

    async def restore(self, job_id: str, states: Sequence[TrajectoryState]
                      ) -> list[TrajectoryState]:
        """Open again the job's sessions a restart interrupted (`states`); the ones it
        could not."""
        ...


class Attempts:
    """Runs attempts (module docstring) on `runtime`, with the suites' `sandboxes`,
    the jobs' rubrics (`judging`) and the turn `journal`."""

    def __init__(self, runtime: Runtime, sandboxes: SuitePools, judging: Judging,
                 journal: JournalWriter, *, tokenizer: Tokenizer | None,
                 harnesses: HarnessRunner | None = None, runners: RayRunners | None = None,
                 runner_retries: int = 2) -> None:
        self.runtime = runtime
        self.sandboxes = sandboxes
        self.judging = judging
        self.journal = journal
        self.tokenizer = tokenizer
        self.harnesses = harnesses
        self.runners = runners  # runner actors the replays run in (None: here)
        self.runner_retries = runner_retries  # new attempts of a replay whose actor is lost

    def start(self) -> None:
        self.journal.start()

    async def close(self) -> None:
        """Write the journal's last turns and close the sandbox pools (after the
        attempts running here were cancelled)."""
        await self.journal.close()
        await self.sandboxes.close()

    async def run(self, work: Work, attempt: int) -> Trajectory:
        p = work.planned
        key = GroupKey(p.group_id, p.repetition)
        tid = p.trajectory_id
        journals = [self.journal.attempt(work.job_id, tid, attempt)]
        journal = journals[0]
        try:
            match work:
                case ReplayWork() if self.runners is not None:
                    return await self._remote(
                        work, attempt, journals,
                        functools.partial(self._replay_in, self.runners, work))
                case SuiteWork() if self.runners is not None and self.runners.runs_tasks:
                    return await self._remote(
                        work, attempt, journals,
                        functools.partial(self._task_in, self.runners, work))
                case ReplayWork():
                    return await replay_task(
                        self.runtime, work.spec, traj_id=tid, key=key, task_id=p.task_id,
                        attempt=attempt, kv=work.kv, journal=journal,
                        resume=await self.journal.resume(work.job_id, tid, attempt),
                        max_staleness=work.max_staleness)
                case HarnessWork():
                    if self.harnesses is None:
                        raise RuntimeError("this service runs no harness jobs")
                    return await self.judging.judged(
                        work, await self.harnesses.run_harness(work, attempt))
                case SuiteWork():
                    if self.tokenizer is None:  # the planner refuses such jobs
                        raise RuntimeError("this service has no tokenizer")
                    capture = self.judging.capture(work)
                    return await self.judging.judged(work, await run_task(
                        self.runtime, work.suite, work.task, traj_id=tid, key=key,
                        tokenizer=self.tokenizer,
                        sandboxes=self.sandboxes.pool(work.suite, work.task),
                        limits=work.limits, sampling=work.sampling,
                        chat_format=work.chat_format, attempt=attempt, kv=work.kv,
                        journal=journal,
                        resume=await self.journal.resume(work.job_id, tid, attempt),
                        capture=capture, max_staleness=work.max_staleness), capture)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("trajectory %s failed outside its agent loop", tid)
            return Trajectory(tid, key, task_id=p.task_id, attempt=attempt,
                              status=TrajectoryStatus.ERROR, failure_stage=FailureStage.RUNTIME,
                              reason=f"runtime: {type(e).__name__}: {e}")
        finally:
            for each in journals:
                each.ended()

    async def _remote(self, work: ReplayWork | SuiteWork, attempt: int,
                      journals: list[AttemptJournal],
                      run: Callable[[int, AttemptJournal], Awaitable[Trajectory]]
                      ) -> Trajectory:
        """`run(attempt, its journal)` (a replay or suite task in a runner actor), run
        again while its actor is lost (module docstring); `journals` gets each
        attempt's journal."""
        p = work.planned
        tid = p.trajectory_id
        key = GroupKey(p.group_id, p.repetition)
        for retry in range(self.runner_retries + 1):
            try:
                return await run(attempt, journals[-1])
            except RunnerLost as e:
                lost = e
            if retry == self.runner_retries:
                break
            again = await self.journal.store.start(work.job_id, tid)
            if again is None:  # finished meanwhile (cancelled): what it returns is dropped
                break
            attempt = again
            log.warning("trajectory %s: %s; attempt %d", tid, lost, attempt)
            journals.append(self.journal.attempt(work.job_id, tid, attempt))
        return Trajectory(tid, key, task_id=p.task_id, attempt=attempt,
                          status=TrajectoryStatus.ERROR, failure_stage=FailureStage.RUNTIME,
                          reason=f"runtime: {lost} (its runner actor was lost "
                                 f"{retry + 1} time(s))")

    async def _replay_in(self, runners: RayRunners, work: ReplayWork, attempt: int,
                         journal: AttemptJournal) -> Trajectory:
        """A replay's attempt in a runner actor (its resume planned here: no tools)."""
        p = work.planned
        plan = await self.journal.resume(work.job_id, p.trajectory_id, attempt)
        return await runners.replay(
            work.spec, traj_id=p.trajectory_id, key=GroupKey(p.group_id, p.repetition),
            task_id=p.task_id, attempt=attempt, kv=work.kv, journal=journal,
            resume=None if plan is None else plan(None), max_staleness=work.max_staleness)

    async def _task_in(self, runners: RayRunners, work: SuiteWork, attempt: int,
                       journal: AttemptJournal) -> Trajectory:
        """A suite task's attempt in a runner actor (its resume planned there), judged
        here with the work tree it read."""
        p = work.planned
        capture = self.judging.capture(work)
        return await self.judging.judged(work, await runners.task(
            work.suite, work.task, traj_id=p.trajectory_id,
            key=GroupKey(p.group_id, p.repetition), sampling=work.sampling,
            limits=work.limits, chat_format=work.chat_format, attempt=attempt, kv=work.kv,
            journal=journal,
            resume=await self.journal.resume_from(work.job_id, p.trajectory_id, attempt),
            capture=capture, max_staleness=work.max_staleness), capture)


__all__ = ["Attempts", "HarnessRunner"]

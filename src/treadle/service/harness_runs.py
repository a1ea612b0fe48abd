"""Harness jobs' runs: a session, the harness command driving it (`gateway.harness`),
the task's episode served to it, then its verdict and score.

A run of a task whose suite needs a sandbox (`Suite.needs_sandbox`) opens the
task's episode when its session starts, in the service's pool for the task (the
`SuitePools` treadle's own agent loop draws from, on the task's image where it has
one), and serves its tools to the harness (`gateway.tools`, ``TREADLE_TOOLS_URL``).
An episode that cannot be opened fails the run before the harness starts (status
error, stage init). The run's verifier then scores that episode, the harness's work
in its sandbox; without one served (no sandbox backend, or a suite that needs
none), a fresh episode scores the final answer. The episode is closed, its sandbox
released, when the run ends, however it ends (the harness's exit or crash, its
timeout, the job's cancel, the service's shutdown: each unwinds this run).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Protocol

from treadle.envs.base import open_episode
from treadle.errors import TreadleError
from treadle.gateway.harness import Harness, HarnessEnv, Verdict, judge, run_harness
from treadle.gateway.session import Session, SessionLimits, SessionSpec, no_call_served
from treadle.gateway.sessions import Sessions
from treadle.gateway.tools import SessionTools
from treadle.runtime.driver import Runtime
from treadle.runtime.suite_pools import SuitePools
from treadle.service.keys import SessionKeys
from treadle.service.planning import HarnessWork
from treadle.types import FailureStage, GroupKey, RewardSource, Trajectory, TrajectoryStatus

log = logging.getLogger(__name__)


class RunHost(Protocol):
    """What a harness run needs of the gateway whose session it drives."""

    url: str | None  # where harnesses reach the service
    keys: SessionKeys
    sandboxes: SuitePools
    harnesses: dict[str, Harness]
    harnessed: set[str]  # trajectories a harness run returns itself

    def open_sessions(self) -> Sessions: ...

    async def context_window(self, runtime: Runtime | None = None) -> int | None: ...

    def track(self, trajectory_id: str, job_id: str) -> None: ...

    def untrack(self, trajectory_id: str) -> None: ...


class HarnessRuns:
    """The harness runs of one gateway (module docstring)."""

    def __init__(self, host: RunHost) -> None:
        self.host = host
        self.served: dict[str, SessionTools] = {}  # session id -> the tools it is served

    async def run(self, work: HarnessWork, attempt: int) -> Trajectory:
        """One trajectory of a harness job; never raises but CancelledError (the
        job's cancel: the harness is killed)."""
        host = self.host
        sessions, p = host.open_sessions(), work.planned
        harness = host.harnesses[work.harness]
        lim = work.limits
        window = await host.context_window()
        spec = SessionSpec(
            session_id=uuid.uuid4().hex[:16], trajectory_id=p.trajectory_id,
            job_id=work.job_id, key=GroupKey(p.group_id, p.repetition), task_id=p.task_id,
            sampling=work.sampling, chat_format=work.chat_format,
            # The job's limits, within what its engines serve.
            limits=SessionLimits(lim.max_turns, min(lim.max_total_tokens,
                                                    window or lim.max_total_tokens),
                                 lim.max_tokens_per_turn),
            swept=False, kv_across_updates=work.kv, max_staleness=work.max_staleness)
        session = sessions.create(spec)  # (ServiceBusy: the job runner records the error)
        host.harnessed.add(p.trajectory_id)
        host.track(p.trajectory_id, work.job_id)
        # The run's only credential: its session's calls, nothing else (docs/security.md).
        key = host.keys.grant(spec.session_id, None, treadle_ends=True)
        try:
            async with contextlib.AsyncExitStack() as episode_held:
                episode_held.push(_teardown_logged(session))  # outermost: sees the close's
                tools = None
                try:
                    tools = await self._serve(work, session, episode_held)
                except TreadleError as e:
                    verdict = Verdict(TrajectoryStatus.ERROR, f"init: the task's episode "
                                      f"could not be opened: {type(e).__name__}: {e}",
                                      FailureStage.INIT)
                else:
                    verdict = await self._run(harness, work, session, key, tools)
                host.keys.revoke(spec.session_id)  # before scoring: nothing of the run is left
                await session.interrupt()  # a call still in flight when the harness ended
                if tools is not None:
                    await tools.stop()  # and a tool call: the sandbox is the run's work now
                if not session.ended:
                    reward = verdict.reward
                    if verdict.verify:
                        reward, rewards, failure = await self._verify(work, session, tools)
                        if failure is not None:
                            verdict = Verdict(TrajectoryStatus.ERROR, failure,
                                              FailureStage.EVAL)
                        verdict = Verdict(verdict.status, verdict.reason, verdict.stage,
                                          reward, {**verdict.rewards, **rewards},
                                          source=RewardSource.VERIFIER)
                    await sessions.end(spec.session_id, status=verdict.status,
                                       reason=verdict.reason, reward=reward,
                                       rewards=verdict.rewards, stage=verdict.stage,
                                       reward_source=verdict.source)
        finally:
            host.keys.revoke(spec.session_id)
            host.harnessed.discard(p.trajectory_id)
            if not session.ended:  # cancelled: the job's cancel stored it already
                session.finish(TrajectoryStatus.ABORTED, "cancelled")
                sessions.forget(spec.session_id)
                host.untrack(p.trajectory_id)
        session.trajectory.attempt = attempt
        no_call_served(session.trajectory)
        return session.trajectory

    async def _serve(self, work: HarnessWork, session: Session,
                     held: contextlib.AsyncExitStack) -> SessionTools | None:
        """The task's episode opened in `held` and served to `session` (None: nothing
        to serve); what `open_episode` raises when it cannot be opened."""
        pool = self.host.sandboxes.pool(work.suite, work.task)
        if pool is None or not work.suite.needs_sandbox(work.task):
            return None
        episode = await held.enter_async_context(open_episode(work.suite, work.task, pool))
        tools = SessionTools(session, episode)
        sid = session.spec.session_id
        self.served[sid] = tools
        # Unwound before the episode closes, however the run ends (a cancel included):
        # no longer served, and a tool call in flight cut, so none runs in a sandbox
        # being released.
        held.push_async_callback(tools.stop)
        held.callback(self.served.pop, sid, None)
        return tools

    async def _run(self, harness: Harness, work: HarnessWork, session: Session, key: str,
                   tools: SessionTools | None) -> Verdict:
        url = self.host.url
        if url is None:
            return Verdict(TrajectoryStatus.ERROR, "runtime: the service does not know the "
                           "URL harnesses reach it at (ServiceConfig.public_url)",
                           FailureStage.RUNTIME)
        task = work.task
        shown = {"task_id": task.task_id, "prompt": task.prompt,
                 "tools": tools.specs if tools is not None
                 else [t.spec for t in work.suite.tools(task)]}
        base = f"{url.rstrip('/')}/v1/sessions/{session.spec.session_id}"
        try:
            run = await run_harness(harness, HarnessEnv(
                f"{base}/openai/v1", key, session.spec.session_id, shown,
                reads_reward=work.score == "reward_file",
                tools_url=None if tools is None else f"{base}/tools"))
        except OSError as e:
            return Verdict(TrajectoryStatus.ERROR, f"harness: cannot start "
                           f"{harness.command[0]!r}: {e}", FailureStage.HARNESS)
        session.final_answer = run.answer
        return judge(run, work.score)

    async def _verify(self, work: HarnessWork, session: Session, tools: SessionTools | None,
                      ) -> tuple[float | None, dict[str, float], str | None]:
        """The suite's reward on the run's final answer, in the served episode (else a
        fresh one): (reward, parts, failure)."""
        answer = session.final_answer if session.final_answer is not None \
            else session.final_text
        try:
            if tools is not None:
                result = await tools.episode.score(answer)
            else:
                async with open_episode(work.suite, work.task,
                                        self.host.sandboxes.pool(work.suite, work.task)
                                        ) as episode:
                    result = await episode.score(answer)
        except TreadleError as e:
            return None, {}, f"eval: {type(e).__name__}: {e}"
        return result.reward, dict(result.metrics), None


def _teardown_logged(session: Session) -> Callable[..., bool]:
    """Swallow (and log) what closing the episode raises once the session has ended:
    a cleanup that fails must not turn a finished, scored run into an excluded one
    (as `runtime.rollout`'s teardown)."""
    def exit_(_type: type[BaseException] | None, exc: BaseException | None,
              _tb: object) -> bool:
        if isinstance(exc, Exception) and session.ended:
            log.warning("session %s: closing its episode failed: %s: %s",
                        session.spec.session_id, type(exc).__name__, exc)
            return True
        return False
    return exit_


__all__ = ["HarnessRuns", "RunHost"]

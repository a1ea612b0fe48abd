"""The open sessions of one service: creation, ends, idle timeouts, sub-agents.

    sessions = Sessions(runtime, tokenizer, on_end=store_it)
    session = sessions.create(SessionSpec(...))
    result = await sessions.call(session.spec.session_id, CallRequest(messages=[...]))
    traj = await sessions.end(session.spec.session_id, reward=1.0)

`on_end` receives every ended trajectory once, children before their parent (the
credit rule and the ways a session ends are in `gateway.session`). Idleness is
timed on `clock` in real seconds: a session whose owner made no call for its
`idle_timeout_s` ends with status timeout, unless it is an orchestrator whose
sub-agents are still open or its owner always ends it (`SessionSpec.swept`).

A session the gateway ended (an engine failure, a refused context, its idle
timeout) waits `grace_s` (the service's is 300 s) for its owner before it is handed
on: the owner's `end` within it scores it (its reward, rewards and metadata; the
status stays what ended it, and an error takes no reward), and a call gets
`SessionEnded`, not a 404. Unscored after `grace_s`, it is handed on as it is. A
harness run's session (`swept` false) has no grace: its run ends and scores it.
Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from treadle.agent.runner import TurnOutput
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import MONOTONIC, Clock
from treadle.errors import ServiceBusy
from treadle.gateway.errors import SessionBusy, SessionEnded, UnknownSession
from treadle.gateway.session import CallRequest, CallResult, Session, SessionSpec
from treadle.runtime.contract import TrajectoryHost
from treadle.runtime.driver import Runtime
from treadle.types import FailureStage, RewardSource, Trajectory, TrajectoryStatus

log = logging.getLogger(__name__)


class Sessions:
    """The live sessions of one service (module docstring). `on_end` receives every
    ended trajectory once (children before their parent); `clock` times idleness in
    real seconds."""

    def __init__(self, runtime: Runtime, tokenizer: Tokenizer, *,
                 on_end: Callable[[Trajectory], Awaitable[None]], clock: Clock = MONOTONIC,
                 max_sessions: int = 4096, sweep_s: float = 1.0,
                 grace_s: float = 0.0, turns: TrajectoryHost | None = None) -> None:
        self.runtime = runtime
        # Where sessions of `runtime` run their turns (None: the runtime; the service's
        # runner actors); a session of another runtime (the frozen pool) runs on it.
        self.turns = turns
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions  # open sessions at once
        self._on_end = on_end
        self._clock = clock
        self._sweep_s = sweep_s  # how often idle sessions are looked for
        self.grace_s = grace_s  # how long a session the gateway ended waits for its owner
        self._grace: dict[str, float] = {}  # session id -> when its grace is over
        self._open: dict[str, Session] = {}
        self._held: dict[str, list[Session]] = {}  # parent id -> children waiting for it
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    def create(self, spec: SessionSpec, runtime: Runtime | None = None, *,
               replay: Sequence[TurnOutput] = ()) -> Session:
        """A new open session whose calls `runtime` serves (default: this registry's),
        its first calls answered by `replay` (a session opened again after a restart);
        ValueError for an unknown chat format, `open_parent`'s errors for its parent,
        ServiceBusy when `max_sessions` are open."""
        self.check_room()
        parent = None if spec.parent_id is None else self.open_parent(spec.parent_id)
        session = Session(spec, runtime or self.runtime, self.tokenizer, self._clock,
                          replay=replay,
                          turns=self.turns if runtime in (None, self.runtime) else None)
        self._open[spec.session_id] = session
        if parent is not None:
            parent.children.append(session)
            session.trajectory.parent_id = parent.spec.trajectory_id
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return session

    def check_room(self) -> None:
        """ServiceBusy when `max_sessions` sessions are open."""
        if len(self._open) >= self.max_sessions:
            raise ServiceBusy(f"{len(self._open)} sessions are open, the most this service "
                              "keeps; end some or retry later")

    def open_parent(self, session_id: str) -> Session:
        """The open session a sub-agent would belong to: UnknownSession if there is
        none, SessionEnded if it has ended (and waits to be handed on)."""
        parent = self.get(session_id)
        if parent.ended:
            raise SessionEnded(f"parent session {session_id} has ended",
                               param="parent_session_id")
        return parent

    def get(self, session_id: str) -> Session:
        try:
            return self._open[session_id]
        except KeyError:
            raise UnknownSession(f"no open session {session_id!r}") from None

    async def call(self, session_id: str, request: CallRequest) -> CallResult:
        """Run a call of an open session; a call that ended it (an engine failure, a
        refused context) hands the session on before its error is raised."""
        session = self.get(session_id)
        try:
            return await session.call(request)
        finally:
            if session.ended:
                await self.settle(session)

    async def end(self, session_id: str, *, status: TrajectoryStatus = TrajectoryStatus.COMPLETED,
                  reason: str | None = None, reward: float | None = None,
                  rewards: Mapping[str, float] | None = None,
                  metadata: Mapping[str, Any] | None = None,
                  stage: FailureStage | None = None,
                  reward_source: RewardSource | None = None) -> Trajectory:
        """End an open session (a call in flight: SessionBusy) and hand it on;
        `reward_source` says what gave `reward` (kept only with one). A session the
        gateway ended, in its grace, is scored instead (its status kept)."""
        session = self.get(session_id)
        if session.busy:
            raise SessionBusy(f"session {session_id} is running a call; end it after")
        traj = session.trajectory
        if session.ended:  # in its grace: what ended it stands
            status = traj.status
        if status is not TrajectoryStatus.ERROR:
            traj.reward = reward
            traj.reward_source = None if reward is None else reward_source
            traj.metrics.update(rewards or {})
        traj.metadata.update(metadata or {})
        session.finish(status, reason, stage)
        await self._settle(session)
        return traj

    async def close(self) -> None:
        """Stop the sweeper; open sessions are forgotten unstored (a restart fails them)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for session in [s for s in self._open.values() if s.spec.session_id in self._grace]:
            try:  # ended already: handed on unscored rather than lost
                await self._settle(session)
            except Exception:
                log.exception("handing on session %s", session.spec.session_id)
        for session in self._open.values():
            session.finish(TrajectoryStatus.ABORTED, "service closed")
        self._open.clear()

    def forget(self, session_id: str) -> None:
        """Drop an ended session unstored (its owner stores its trajectory)."""
        self._open.pop(session_id, None)
        self._held.pop(session_id, None)
        self._grace.pop(session_id, None)

    def abort_job(self, job_id: str) -> list[Trajectory]:
        """End the open sessions of a cancelled job, unstored (the store has aborted
        them already); their trajectories."""
        out = []
        for session in [s for s in self._open.values() if s.spec.job_id == job_id]:
            session.finish(TrajectoryStatus.ABORTED, "cancelled")
            del self._open[session.spec.session_id]
            self._grace.pop(session.spec.session_id, None)
            out.append(session.trajectory)
        for parent in [p for p in self._held if p not in self._open]:
            del self._held[parent]
        return out

    async def settle(self, session: Session) -> None:
        """A session that ended by itself (an engine failure, a refused context): it
        waits out its grace for its owner, or is handed on now (no grace: a harness
        run's, or a grace of 0)."""
        sid = session.spec.session_id
        if sid not in self._open or not session.ended or sid in self._grace:
            return
        if session.spec.swept and self.grace_s > 0:
            self._grace[sid] = self._clock.now() + self.grace_s
            return
        await self._settle(session)

    async def _settle(self, session: Session) -> None:
        self._open.pop(session.spec.session_id, None)
        self._grace.pop(session.spec.session_id, None)
        traj = session.trajectory
        for child in session.children:
            if not child.ended:  # settled as any ended session is: its own children too
                child.finish(TrajectoryStatus.ABORTED, "its parent session ended")
                await self._settle(child)
        for child in self._held.pop(session.spec.session_id, []):
            child.trajectory.reward = traj.reward  # the parent's credit, and its source
            child.trajectory.reward_source = traj.reward_source
            await self._on_end(child.trajectory)
        parent = self._open.get(session.spec.parent_id or "")
        if parent is not None and traj.reward is None and \
                traj.status not in (TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED):
            self._held.setdefault(parent.spec.session_id, []).append(session)
            return
        await self._on_end(traj)

    async def _sweep(self) -> None:
        while True:
            await self._clock.sleep(self._sweep_s)
            now = self._clock.now()
            for sid, over in list(self._grace.items()):
                session = self._open.get(sid)
                if session is not None and now >= over:
                    try:  # its owner did not come: handed on unscored
                        await self._settle(session)
                    except Exception:
                        log.exception("handing on session %s", sid)
            for session in list(self._open.values()):
                idle = session.spec.limits.idle_timeout_s
                # An orchestrator waits while its sub-agents work; a harness run ends
                # its own session (its time limit is the harness's).
                waiting = any(not c.ended for c in session.children) or not session.spec.swept
                if not session.busy and not session.ended and not waiting \
                        and now - session.last_active >= idle:
                    try:  # ended by the gateway: its owner may still score it
                        session.finish(TrajectoryStatus.TIMEOUT, "idle_timeout")
                        await self.settle(session)
                    except Exception:  # one bad session must not stop the sweep
                        log.exception("ending idle session %s", session.spec.session_id)



__all__ = ["Sessions"]

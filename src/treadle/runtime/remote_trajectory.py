"""A trajectory running in a runner actor, as the service's runtime sees it.

`RemoteTrajectory` is the `contract.Runner` that `runtime.ray_runners` hands the
runtime for each trajectory it runs in an actor: what the runtime tells the
trajectory (admissions, preemptions, engines lost, a pause's abort, a failure) is
sent to the actor; what the runtime reads of it (`waiting_since`, `admitted_to`,
`calling_on`, `sampled`) follows from what the actor says its runner did (events,
calls started and ended). It ends for the scheduler when its runner says so
(`Done`), when its record comes back (`Finished`), or when its actor is lost
(`lost`: its call released from the pool, `TrajectoryEnded` if the scheduler knew of
it, and its `result` the `RunnerLost` error).

`RemoteTurns` is the `TurnRunner` of a trajectory whose conversation stays in the
service (a gateway session's) while its runner is an actor's: each turn is a
`Generate` answered by a `Generated`, each of the conversation's events a message
to the runner, in order. Its actor lost, the turn in flight and every later one
raise `EngineUnavailable`: the session ends its trajectory as an infrastructure
failure, as it would on an engine lost for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from treadle.agent.runner import Sampling, TurnOutput
from treadle.core.events import (
    ToolCallFinished,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnPreempted,
)
from treadle.engines.errors import EngineError, EngineUnavailable
from treadle.envs.worktree import WorkTreeCapture
from treadle.errors import TreadleError
from treadle.runtime.driver import Runtime
from treadle.runtime.pool import EngineSlot
from treadle.runtime.runner_wire import (
    AbortForPause,
    AdmitTurn,
    CallEnded,
    CallStarted,
    CancelCall,
    Captured,
    Done,
    EngineLost,
    FailTurn,
    Finished,
    Generate,
    Generated,
    Journaled,
    PreemptTurn,
    Resumed,
    Sampled,
    Told,
    ToolBegan,
    ToolDone,
    ToRunner,
    ToService,
    TurnDone,
    TurnsEnded,
)
from treadle.types import KVAcrossUpdates, ResumePoint, Trajectory


class BodyJournal(Protocol):
    """Where a remote trajectory's journal goes (the service's `AttemptJournal`): as
    `agent.journal.TurnJournal`, its turns already encoded by the runner, and the
    resume its runner planned."""

    def sampled(self, tokens: int) -> None: ...

    def turn_body(self, index: int, tokens: int, body: bytes) -> None: ...

    def resumed(self, point: ResumePoint) -> None: ...


class RunnerLost(TreadleError):
    """The runner actor of a trajectory was lost before the trajectory finished."""


class RunnerFailure(TreadleError):
    """A trajectory's run raised in its runner actor (the actor lives on): a runtime
    error of that trajectory, recorded as one, not run again as a lost runner's."""


class RemoteTrajectory:
    """A trajectory running in a runner actor, as the runtime sees it (`contract.Runner`):
    what the runtime tells it goes to the actor, what it reads is tracked from the
    actor's messages."""

    def __init__(self, send: Callable[[ToRunner], None], runtime: Runtime, traj_id: str,
                 kv: KVAcrossUpdates, journal: BodyJournal | None,
                 capture: WorkTreeCapture | None = None, *, driven: bool = False) -> None:
        self.traj_id = traj_id
        self.kv = kv
        self.sampled = 0
        self._send = send  # to its actor
        self.journal = journal
        self.capture = capture  # given the work tree its runner read (`Captured`)
        self.result: asyncio.Future[Trajectory | str] = (
            asyncio.get_running_loop().create_future())
        # Read by whoever waits for it; nobody does for a driven trajectory, nor once
        # its waiter was cancelled: its error is not one to log as unretrieved.
        self.result.add_done_callback(_retrieved)
        self._rt = runtime
        self._since: float | None = None  # when its turn began waiting for an admission
        self._admitted: str | None = None
        self._calling: EngineSlot | None = None
        self._arrived = False
        self.done = False
        self.driven = driven  # its conversation is the service's (RemoteTurns): no record
        self.calls: dict[int, asyncio.Future[TurnOutput]] = {}  # driven turns, in flight
        self.lost_why: str | None = None  # its actor was lost (why)

    # -- contract.Runner -----------------------------------------------------------------

    @property
    def waiting_since(self) -> float | None:
        return None if self.done or self._admitted is not None else self._since

    @property
    def admitted_to(self) -> str | None:
        return self._admitted

    @property
    def calling_on(self) -> str | None:
        return None if self._calling is None else self._calling.engine_id

    def admit(self, engine_id: str, priority: float) -> None:
        self._admitted = engine_id
        self._send(AdmitTurn(self.traj_id, engine_id, priority))

    def preempt(self, engine_id: str) -> None:
        self._waiting()
        self._send(PreemptTurn(self.traj_id, engine_id))

    def engine_lost(self, engine_id: str) -> None:
        if self._admitted == engine_id or self.calling_on == engine_id:
            self._waiting()
            self._send(EngineLost(self.traj_id, engine_id))

    def abort_for_pause(self) -> None:
        if self._calling is not None:
            self._send(AbortForPause(self.traj_id))

    def fail(self, error: EngineError) -> None:
        self._since = None  # failed: not waiting (until an admission)
        self._send(FailTurn(self.traj_id, error))

    # -- what its actor says ---------------------------------------------------------------

    def hear(self, m: ToService) -> None:
        if isinstance(m, Told):
            if isinstance(m.event, TrajectoryArrived):
                self._arrived = True
            if _readies(m.event):
                self._waiting()
            self._rt.tell(m.event)
        elif isinstance(m, CallStarted):
            # Admitted and calling: not waiting (a local runner's `waiting_since` is None
            # from its admission until its next wait, which a Told event starts here).
            self._admitted, self._since = None, None
            slot = self._rt.pool.get(m.engine_id)
            if slot is not None:
                self._calling = slot
                self._rt.call_started(slot)
        elif isinstance(m, CallEnded):
            self.sampled = m.sampled
            self._release_call()
        elif isinstance(m, Sampled):
            if self.journal is not None:
                self.journal.sampled(m.tokens)
        elif isinstance(m, Journaled):
            if self.journal is not None:
                self.journal.turn_body(m.index, m.tokens, m.body)
        elif isinstance(m, Resumed):
            if self.journal is not None:
                self.journal.resumed(m.point)
        elif isinstance(m, Captured):
            if self.capture is not None:
                self.capture.tree, self.capture.error = m.tree, m.error
        elif isinstance(m, Generated):
            call = self.calls.pop(m.call, None)
            if call is not None and not call.done():
                if m.output is not None:
                    call.set_result(m.output)
                else:
                    call.set_exception(m.error if m.error is not None
                                       else RunnerFailure(m.failure))
        elif isinstance(m, Done):
            self._end(None)
        elif isinstance(m, Finished):
            self._end("ended in its runner")
            if self.result.done():
                pass
            elif m.raised:
                self.result.set_exception(RunnerFailure(m.error))
            else:
                self.result.set_result(m.error if m.trajectory is None else m.trajectory)

    def lost(self, why: str) -> None:
        """Its actor is gone: the runtime forgets it, its `replay` raises RunnerLost,
        its driven turns EngineUnavailable."""
        self.lost_why = why
        self._end("runner lost")
        if not self.result.done():
            self.result.set_exception(RunnerLost(why))
        for call in self.calls.values():
            if not call.done():
                call.set_exception(self.unavailable())
        self.calls.clear()

    def unavailable(self) -> EngineUnavailable:
        """What its driven turns raise once its actor is lost."""
        return EngineUnavailable(f"its runner actor was lost: {self.lost_why}")

    def _waiting(self) -> None:
        self._admitted = None
        self._since = self._rt.clock.now()

    def _release_call(self) -> None:
        if self._calling is not None:
            self._rt.call_ended(self._calling)
            self._calling = None

    def _end(self, reason: str | None) -> None:
        """No more events; `reason`: end it for the scheduler first (none came)."""
        self._release_call()
        if self.done:
            return
        self.done = True
        if reason is not None and self._arrived:
            self._rt.tell(TrajectoryEnded(self.traj_id, reason))
        self._rt.trajectory_done(self)


class RemoteTurns:
    """The `TurnRunner` of a trajectory driven from the service whose runner is an
    actor's (module docstring); `traj` is its proxy, adopted by the runtime."""

    def __init__(self, traj: RemoteTrajectory, send: Callable[[ToRunner], None],
                 runtime: Runtime) -> None:
        self._traj = traj
        self._send = send
        self._rt = runtime
        self._calls = 0

    @property
    def policy_version(self) -> int:
        return self._rt.policy_version

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       stop_ids: list[int]) -> TurnOutput:
        traj = self._traj
        if traj.lost_why is not None:
            raise traj.unavailable()
        self._calls += 1
        call = self._calls
        answer: asyncio.Future[TurnOutput] = asyncio.get_running_loop().create_future()
        traj.calls[call] = answer
        self._send(Generate(traj.traj_id, call, prompt_ids, max_tokens, sampling, stop_ids))
        try:
            return await answer
        except asyncio.CancelledError:
            traj.calls.pop(call, None)
            self._send(CancelCall(traj.traj_id, call))
            raise

    def turn_finished(self, output_tokens: int, context_tokens: int, final: bool) -> None:
        self._send(TurnDone(self._traj.traj_id, output_tokens, context_tokens, final))

    def tool_started(self) -> None:
        self._send(ToolBegan(self._traj.traj_id))

    def tool_finished(self, latency_s: float, output_tokens: int, final: bool) -> None:
        self._send(ToolDone(self._traj.traj_id, latency_s, output_tokens, final))

    def ended(self, reason: str) -> None:
        self._send(TurnsEnded(self._traj.traj_id, reason))


def _retrieved(future: asyncio.Future[Trajectory | str]) -> None:
    if not future.cancelled():
        future.exception()


def _readies(event: object) -> bool:
    """Whether `event` makes the trajectory's next turn wait for an admission."""
    return isinstance(event, TrajectoryArrived | TurnPreempted) or (
        isinstance(event, ToolCallFinished) and not event.final)



__all__ = ["BodyJournal", "RemoteTrajectory", "RemoteTurns", "RunnerFailure", "RunnerLost"]

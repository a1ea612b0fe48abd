"""One runner actor as the service sees it: `RunnerChannel`, its exchanges.

A Ray call costs the service far more CPU than a message in it (`runtime.call_pacer`),
so both ways travel in one call where they can. Per actor (`runtime.ray_runners`)
one `exchange` is in flight at a time: it carries every message sent to the actor
since the last one left, and comes back with everything the actor's trajectories
did since the last came back (the actor answers once there is something, its
answers `call_gap_s` apart while they keep coming). Each message that comes back
is handed to its trajectory's proxy (`RemoteTrajectory`), a hold's acknowledgement
to the hold, a failed call's question to the runtime (whose verdict goes back as an
`Answer`). The next exchange leaves as soon as the last is back, after one loop
turn, so that what its answer made the scheduler decide rides it. Under load an
actor answers every `call_gap_s`: one call a gap carries both ways, where a call
each way would make two.

An actor with nothing to say (its trajectories all in long tool calls) holds its
exchange for as long as that lasts, minutes perhaps. Messages sent meanwhile do not
wait for it: once they have waited `call_gap_s`, a side `push` takes them (one in
flight at a time, their starts `call_gap_s` apart as well), so a message waits at
most about `call_gap_s` longer than if every batch went at once, and under load
(the exchange back within the gap) no side push is made.

Every batch, an exchange's or a side push's, carries a sequence number from one
counter: Ray does not promise that two calls of an asyncio actor start in the
order they were made, and a message must not overtake one sent before it (a
preemption its admission, a resume its hold), so the actor applies the batches in
that order (`runtime.batch_order`). What comes back needs none: it travels on exchanges
only, one at a time.

Either call failing (its actor gone) reports the loss once, to `lost`; the fleet
decides the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal

from treadle.clock import MONOTONIC, Clock
from treadle.runtime.driver import Runtime
from treadle.runtime.remote_trajectory import RemoteTrajectory
from treadle.runtime.runner_wire import (
    Answer,
    CallFailed,
    Done,
    Finished,
    Held,
    Hold,
    Packed,
    ToRunner,
    ToService,
    pack,
    unpack,
)

log = logging.getLogger(__name__)


class RunnerChannel:
    """One runner actor and its calls (module docstring); `lost` is called, once,
    when one fails. `clock`: real seconds, for the side pushes' wait."""

    def __init__(self, name: str, actor: Any, runtime: Runtime, *, call_gap_s: float,
                 lost: Callable[[RunnerChannel, str], None],
                 clock: Clock = MONOTONIC) -> None:
        self.name = name
        self.actor = actor
        self.pid = 0  # its process, once it answered
        self.node_id = ""
        self.trajectories: dict[str, RemoteTrajectory] = {}
        self.ran = 0  # trajectories it finished
        self.suites: set[str] = set()  # keys of the suites sent to it (KeepSuite)
        self.alive = True
        self.ready = False  # it answered: trajectories may go to it
        self._runtime = runtime
        self._clock = clock
        self._gap_s = call_gap_s  # how long a message waits before a side push takes it
        self._lost = lost
        self._failed = False  # a call failed: the loss is reported
        self._outbox: list[ToRunner] = []
        self._queued = asyncio.Event()  # set while the outbox holds something
        self._queued_at = 0.0  # when the outbox's oldest message came (`clock`)
        self._seq = 0  # the last batch's sequence number (`runtime.batch_order`)
        self._holds: dict[int, asyncio.Future[None]] = {}
        self._answers: set[asyncio.Task[None]] = set()  # verdicts on failed calls, pending
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        """Start its calls (what was sent before goes first), then wait until it
        answers."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._exchange()),
                       loop.create_task(self._side_push())]
        self.pid, self.node_id = await self.actor.where.remote()
        self.ready = True

    def send(self, message: ToRunner) -> None:
        if self.alive:
            if not self._outbox:
                self._queued_at = self._clock.now()
                self._queued.set()
            self._outbox.append(message)

    def hold(self, hold_id: int) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.alive:
            future.set_result(None)
            return future
        self._holds[hold_id] = future
        self.send(Hold(hold_id))
        return future

    def _take(self) -> tuple[int, list[Packed]]:
        """The outbox as the next batch: its sequence number and its messages."""
        batch, self._outbox = self._outbox, []
        self._queued.clear()
        self._seq += 1
        return self._seq, pack(batch)

    async def _exchange(self) -> None:
        try:
            while True:
                # One loop turn first: the scheduler decides on what the last answer
                # told it in a later callback of the same iteration
                # (`control.DecisionLoop`), and those decisions ride this exchange.
                await asyncio.sleep(0)
                seq, batch = self._take()  # empty, too: it is the long poll
                for m in unpack(await self.actor.exchange.remote(seq, batch)):
                    try:
                        self._hear(m)
                    except Exception:  # a bug here must not stop the actor's exchanges
                        log.exception("runner %s: a message failed: %r", self.name, m)
        except Exception as e:  # its actor gone (Ray's actor error), or a batch refused
            self._fail(e)

    async def _side_push(self) -> None:
        """Messages the in-flight exchange did not take within `call_gap_s` of the
        oldest's sending go by a push (module docstring)."""
        try:
            while True:
                await self._queued.wait()
                if not self._outbox:  # taken by an exchange before this woke
                    continue
                wait_s = self._queued_at + self._gap_s - self._clock.now()
                if wait_s > 0:
                    # Then look again: taken by an exchange meanwhile (under load),
                    # or other messages queued since, with a later deadline.
                    await self._clock.sleep(wait_s)
                    continue
                # What is queued now came after the last push took the outbox, so
                # pushes start `call_gap_s` apart at least, as the exchanges' answers.
                await self.actor.push.remote(*self._take())
        except Exception as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        """A call failed: the loss reported, once (the other call fails too, unless
        `lost` closes this channel first)."""
        if not self._failed:
            self._failed = True
            self._lost(self, f"runner {self.name} lost: {type(e).__name__}: {e}")

    def _hear(self, m: ToService) -> None:
        if isinstance(m, Held):
            future = self._holds.pop(m.hold_id, None)
            if future is not None and not future.done():
                future.set_result(None)
        elif isinstance(m, CallFailed):
            task = asyncio.get_running_loop().create_task(self._answer(m))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)
        else:
            traj = self.trajectories.get(m.traj_id)
            if traj is not None:
                traj.hear(m)
                # Its end here: its record, or, driven from the service, its last event.
                if isinstance(m, Finished) or (isinstance(m, Done) and traj.driven):
                    del self.trajectories[m.traj_id]
                    self.ran += 1

    async def _answer(self, m: CallFailed) -> None:
        """The runtime's verdict on a failed call, always answered (the actor's turn
        waits for it): "failed" when finding it out raised."""
        slot = self._runtime.pool.get(m.engine_id)
        verdict: Literal["failed", "retry"] = "failed"
        try:
            if slot is not None:
                verdict = await self._runtime.call_failed(slot, m.error)
        except Exception:
            log.exception("runner %s: no verdict on a failed call of %s", self.name,
                          m.traj_id)
            verdict = "failed"
        self.send(Answer(m.query_id, verdict))

    def close(self) -> list[asyncio.Task[None]]:
        """Stop its calls; it sends and hears nothing more. Its trajectories are
        lost (`lost`), its holds answered."""
        self.alive = False
        for task in [*self._tasks, *self._answers]:
            if task is not asyncio.current_task():
                task.cancel()
        for future in self._holds.values():
            if not future.done():
                future.set_result(None)
        self._holds.clear()
        return self._tasks


__all__ = ["RunnerChannel"]

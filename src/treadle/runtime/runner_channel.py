"""One runner actor as the service sees it: `RunnerChannel`, its two streams.

Per actor (`runtime.ray_runners`), one `push` in flight at a time carries every
message sent to it meanwhile (the pushes paced `call_gap_s` apart under load:
`runtime.call_pacer`), and one long `pull` brings back everything its trajectories
did since the last: each
message is handed to its trajectory's proxy (`RemoteTrajectory`), a hold's
acknowledgement to the hold, a failed call's question to the runtime (whose verdict
goes back as an `Answer`). Either stream failing (its actor gone) reports the loss
once, to `lost`; the fleet decides the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal

from treadle.runtime.call_pacer import CallPacer
from treadle.runtime.driver import Runtime
from treadle.runtime.remote_trajectory import RemoteTrajectory
from treadle.runtime.runner_wire import (
    Answer,
    CallFailed,
    Done,
    Finished,
    Held,
    Hold,
    ToRunner,
    ToService,
    pack,
    unpack,
)

log = logging.getLogger(__name__)


class RunnerChannel:
    """One runner actor and its two streams (module docstring); `lost` is called,
    once, when either stream fails."""

    def __init__(self, name: str, actor: Any, runtime: Runtime, *, call_gap_s: float,
                 lost: Callable[[RunnerChannel, str], None]) -> None:
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
        self._pacer = CallPacer(call_gap_s)  # the pushes' starts
        self._lost = lost
        self._outbox: list[ToRunner] = []
        self._pending = asyncio.Event()
        self._holds: dict[int, asyncio.Future[None]] = {}
        self._answers: set[asyncio.Task[None]] = set()  # verdicts on failed calls, pending
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        """Start its streams (what was sent before goes first), then wait until it
        answers."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._push()), loop.create_task(self._pull())]
        self.pid, self.node_id = await self.actor.where.remote()
        self.ready = True

    def send(self, message: ToRunner) -> None:
        if self.alive:
            self._outbox.append(message)
            self._pending.set()

    def hold(self, hold_id: int) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.alive:
            future.set_result(None)
            return future
        self._holds[hold_id] = future
        self.send(Hold(hold_id))
        return future

    async def _push(self) -> None:
        try:
            while True:
                await self._pending.wait()
                await self._pacer.wait()
                batch, self._outbox = self._outbox, []
                self._pending.clear()
                await self.actor.push.remote(pack(batch))
        except Exception as e:  # its actor gone (Ray's actor error), or a batch refused
            self._lost(self, f"runner {self.name} lost: {type(e).__name__}: {e}")

    async def _pull(self) -> None:
        try:
            while True:
                for m in unpack(await self.actor.pull.remote()):
                    try:
                        self._hear(m)
                    except Exception:  # a bug here must not stop the actor's stream
                        log.exception("runner %s: a message failed: %r", self.name, m)
        except Exception as e:
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
        """Stop its streams; it sends and hears nothing more. Its trajectories are
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

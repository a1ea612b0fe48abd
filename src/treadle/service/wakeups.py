"""Waking the followers of a job when it gets a result or ends.

    wakeups = JobWakeups()
    changed = wakeups.future(job_id)    # before reading what is there
    try:
        ...read the store...
        await asyncio.wait({changed}, timeout=heartbeat_s)
    finally:
        wakeups.leave(job_id, changed)
    wakeups.wake(job_id)                # after a result of the job is stored

`wake` is synchronous and takes no lock: nothing a follower does with its stream
(hanging up, being cancelled once or again and again, as anyio's cancel scopes do,
never reading) can hold back a trajectory's completion. A follower takes the future
*before* it reads the store, so a result stored between its read and its wait
still wakes it: no wake-up is lost, and the poll timeout is only a backstop.

Why not `asyncio.Condition`: a follower waiting in `wait_for(cond.wait(), t)` that
is cancelled a second time while the inner wait re-acquires the lock leaves the
lock held for ever on Python 3.11 (its `async with` releases a lock it does not
hold, then the inner wait takes it); every later notifier then blocks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[None]  # resolved at the job's next wake
    holders: int = 0  # followers that took it and have not left it yet


class JobWakeups:
    """One future per job with followers, resolved (and dropped) by the job's next
    wake, or dropped when the last follower holding it leaves it."""

    def __init__(self) -> None:
        self._next: dict[str, _Pending] = {}  # job id -> its pending wake-up

    def future(self, job_id: str) -> asyncio.Future[None]:
        """Resolved at the next `wake(job_id)`. Await it with `asyncio.wait`, which
        never cancels it (other followers share it), and hand it back with `leave`
        (in a `finally`), so that a job nobody follows any more holds nothing."""
        pending = self._next.get(job_id)
        if pending is None:
            pending = self._next[job_id] = _Pending(asyncio.get_running_loop().create_future())
        pending.holders += 1
        return pending.future

    def leave(self, job_id: str, future: asyncio.Future[None]) -> None:
        """A follower is done with `future` (woken or not)."""
        pending = self._next.get(job_id)
        if pending is not None and pending.future is future:
            pending.holders -= 1
            if pending.holders <= 0:
                del self._next[job_id]

    def wake(self, job_id: str) -> None:
        """Wake every follower of the job; never blocks."""
        pending = self._next.pop(job_id, None)
        if pending is not None and not pending.future.done():
            pending.future.set_result(None)

    @property
    def jobs(self) -> int:
        """Jobs with a pending wake-up (for tests and metrics)."""
        return len(self._next)


__all__ = ["JobWakeups"]

"""Test doubles that ship with treadle, for its tests and for code built on it.

`FakeClock` is the `treadle.clock.Clock` of tests: its seconds pass only when the
test says so, so a test of timeouts, grace periods, back-offs and rates runs exactly
and at once, and cannot fail because the machine is slow.

    clock = FakeClock()
    runtime = Runtime(scheduler, clock=clock, engine_wait_s=60)
    ...
    clock.advance(59.9)        # nothing has timed out yet
    clock.advance(0.1)         # now it has

With `autojump=True` (trio's `MockClock(autojump_threshold=0)`) it advances by
itself: whenever no task can run, it jumps to the earliest pending sleep or timeout.
A whole batch of fake engines and trajectories then plays out like a discrete-event
simulation, in as many loop iterations as it has events. That is exact only while
everything the test waits for is in the event loop: a thread, a subprocess or a
socket makes progress that the clock cannot see, and the clock jumps past it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from types import TracebackType

__all__ = ["FakeClock"]


@dataclass(order=True, slots=True)
class _Timer:
    when: float  # clock time it fires at
    seq: int  # ties fire in the order they were set
    fire: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)  # dropped when it reaches the top


class FakeClock:
    """A `Clock` whose time moves only by `advance` (or, with `autojump`, when the
    event loop is idle; that needs asyncio's default event loop, whose ready queue
    it reads). `real_seconds` is 0: nothing of it takes real time."""

    def __init__(self, start: float = 0.0, *, autojump: bool = False) -> None:
        self._now = start
        self.autojump = autojump
        self._timers: list[_Timer] = []  # heap by (when, seq)
        self._seq = itertools.count()
        self._jumper: asyncio.Task[None] | None = None
        self._armed: asyncio.Event | None = None  # a timer was set (wakes the jumper)

    # -- Clock ------------------------------------------------------------------------

    def now(self) -> float:
        return self._now

    def real_seconds(self, seconds: float) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        done = asyncio.get_running_loop().create_future()

        def fire() -> None:
            if not done.done():
                done.set_result(None)

        timer = self._set(self._now + seconds, fire)
        try:
            await done
        finally:
            timer.cancelled = True

    def timeout(self, seconds: float | None) -> _FakeTimeout:
        return _FakeTimeout(self, seconds)

    # -- the test's hand ------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`: every sleep and timeout due by then fires,
        in the order of their times; the tasks they wake run after this returns (and
        see the new time)."""
        if seconds < 0:
            raise ValueError(f"time only moves forward, not by {seconds}")
        target = self._now + seconds
        while (timer := self._next()) is not None and timer.when <= target:
            self._fire(timer)
        self._now = target

    @property
    def pending(self) -> int:
        """Sleeps and timeouts not yet fired or cancelled."""
        return sum(not t.cancelled for t in self._timers)

    def next_deadline(self) -> float | None:
        """When the earliest pending sleep or timeout fires, or None."""
        timer = self._next()
        return None if timer is None else timer.when

    # -- internals --------------------------------------------------------------------

    def _set(self, when: float, fire: Callable[[], None]) -> _Timer:
        timer = _Timer(when, next(self._seq), fire)
        heapq.heappush(self._timers, timer)
        if self.autojump:
            self._ensure_jumper()
        return timer

    def _next(self) -> _Timer | None:
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0] if self._timers else None

    def _fire(self, timer: _Timer) -> None:
        heapq.heappop(self._timers)
        self._now = max(self._now, timer.when)
        timer.cancelled = True
        timer.fire()

    def _ensure_jumper(self) -> None:
        loop = asyncio.get_running_loop()
        if self._jumper is None or self._jumper.done() or self._jumper.get_loop() is not loop:
            ready = getattr(loop, "_ready", None)
            if not isinstance(ready, Sized):
                raise TypeError("FakeClock(autojump=True) needs asyncio's default event loop")
            self._armed = asyncio.Event()
            self._jumper = loop.create_task(self._jump_when_idle(ready, self._armed))
        else:
            assert self._armed is not None
            self._armed.set()

    async def _jump_when_idle(self, ready: Sized, armed: asyncio.Event) -> None:
        """Yield to every task that can run; when none can, fire the earliest timer
        (and any set for the same instant)."""
        while True:
            await asyncio.sleep(0)
            if len(ready):
                continue  # something ran and set more going: not idle yet
            timer = self._next()
            if timer is None:
                armed.clear()
                await armed.wait()
                continue
            when = timer.when
            while (timer := self._next()) is not None and timer.when == when:
                self._fire(timer)


class _FakeTimeout:
    """`FakeClock.timeout`: asyncio's own `Timeout`, told to expire now when the fake
    deadline fires, so cancellation and `TimeoutError` behave exactly as asyncio's."""

    def __init__(self, clock: FakeClock, seconds: float | None) -> None:
        self._clock = clock
        self._seconds = seconds
        self._inner = asyncio.timeout(None)
        self._timer: _Timer | None = None

    async def __aenter__(self) -> _FakeTimeout:
        await self._inner.__aenter__()
        if self._seconds is not None:
            loop = asyncio.get_running_loop()

            def expire() -> None:
                if not self._inner.expired():
                    self._inner.reschedule(loop.time())

            if self._seconds <= 0:
                expire()
            else:
                self._timer = self._clock._set(self._clock.now() + self._seconds, expire)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancelled = True
        await self._inner.__aexit__(exc_type, exc, tb)  # raises TimeoutError if it expired

    def expired(self) -> bool:
        """Whether the block timed out."""
        return self._inner.expired()

"""Time for everything in treadle that waits: one `Clock`, read, slept on, timed out on.

The scheduling core takes time as an argument and never reads a clock. Every layer
above it that waits does so on a `Clock` — the runtime's wake-ups, grace periods,
relaunch back-offs and health checks, the agent loop's deadline, the sandbox pool's
rate limit and close grace, the sandbox server's idle reaper — so that one object
decides what a second is:

- `WallClock()`: real seconds since it was made (what a service runs on);
- `ScaledClock(scale)`: a modelled world `1/scale` times faster than real. With
  `scale=0.05` one second of the clock passes in 50 ms, so a trace recorded on a
  real cluster (and engines emulated with the same `--time-scale`) replays 20x
  faster while the scheduler sees the trace's own seconds;
- `MONOTONIC`: a `WallClock` whose `now()` is `time.monotonic()`, the default of
  code that runs outside a runtime (a single rollout, an evaluation);
- `treadle.testing.FakeClock`: seconds that pass only when a test says so.

A duration handed to something that does not wait on the clock — an HTTP client's
request timeout, a sandboxed command's wall-clock limit — is real seconds;
`real_seconds` converts a clock duration into one.

Not this clock: the store's timestamps are epoch seconds (`time.time()`), comparable
across processes and restarts; the store takes its own `Callable[[], float]`.

Importable from every layer but `core/`, which stays free of time and asyncio.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol


class Clock(Protocol):
    """What waiting code needs of time. All seconds are this clock's."""

    def now(self) -> float:
        """Seconds on this clock; never decreases."""
        ...

    def real_seconds(self, seconds: float) -> float:
        """Real seconds that `seconds` of this clock take (0 for negative ones)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once `seconds` have passed on this clock (at once for <= 0)."""
        ...

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        """`async with clock.timeout(s):` cancels its block after `s` seconds of this
        clock and raises `TimeoutError` out of it, as `asyncio.timeout` does; None
        never times out, <= 0 times out at the block's first await."""
        ...


class ScaledClock:
    """Clock seconds = real seconds / `scale`, counted from `origin` (default: the
    clock's creation, on `monotonic`)."""

    def __init__(self, scale: float = 1.0, *, monotonic: Callable[[], float] = time.monotonic,
                 origin: float | None = None) -> None:
        if not scale > 0:
            raise ValueError(f"time scale must be > 0, got {scale}")
        self.scale = scale
        self._monotonic = monotonic
        self._origin = monotonic() if origin is None else origin

    def now(self) -> float:
        return (self._monotonic() - self._origin) / self.scale

    def real_seconds(self, seconds: float) -> float:
        return max(0.0, seconds) * self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(self.real_seconds(seconds))

    def timeout(self, seconds: float | None) -> AbstractAsyncContextManager[object]:
        return asyncio.timeout(None if seconds is None else self.real_seconds(seconds))


class WallClock(ScaledClock):
    """Real seconds since the clock was created (or since `origin` on `monotonic`)."""

    def __init__(self, *, monotonic: Callable[[], float] = time.monotonic,
                 origin: float | None = None) -> None:
        super().__init__(1.0, monotonic=monotonic, origin=origin)


MONOTONIC = WallClock(origin=0.0)  # now() is time.monotonic(): comparable within a process

"""The runtime's clock: the time the scheduler is told, and how to wait on it.

The scheduling core takes time as an argument; the runtime reads it from a `Clock`.
`WallClock` is seconds since the runtime started. `ScaledClock(scale)` runs a
modelled world `1/scale` times faster than real: with `scale=0.05`, one second of
the clock passes in 50 ms, so a trace recorded on a real cluster (and engines
emulated with the same `--time-scale`) replays 20x faster while the scheduler sees
the trace's own seconds — its re-planning periods, tool latencies and queueing
delays keep their meaning.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock (monotonic)."""
        ...

    def real_seconds(self, seconds: float) -> float:
        """Real seconds that `seconds` of this clock take."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock."""
        ...


class ScaledClock:
    """Clock seconds = real seconds / `scale`, from the clock's creation."""

    def __init__(self, scale: float = 1.0, *,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not scale > 0:
            raise ValueError(f"time scale must be > 0, got {scale}")
        self.scale = scale
        self._monotonic = monotonic
        self._origin = monotonic()

    def now(self) -> float:
        return (self._monotonic() - self._origin) / self.scale

    def real_seconds(self, seconds: float) -> float:
        return max(0.0, seconds) * self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(self.real_seconds(seconds))


class WallClock(ScaledClock):
    """Real seconds since the clock was created."""

    def __init__(self, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__(1.0, monotonic=monotonic)

"""`Monitor`: the service's recent history and its engines' own load, for the
dashboard (docs/dashboard.md) and any client that polls `GET /v1/status`.

Every `interval_s` real seconds the monitor takes a `Sample` of the service's
counters: the tokens the engines sampled and the trajectories that finished since
the last sample (as rates per real second), the trajectories running and queued
here, and how long the oldest running one has run — a batch's long tail is a few
trajectories running on while the rest are done. It keeps the latest `keep`
samples (ten minutes at one a second): a page opened late still draws the recent
past.

While someone watches (a status or engine view was read in the last `watch_s`
seconds), each sample also reads every engine's own metrics (`Engine.load`:
running, waiting, KV use), all at once, each bounded by `interval_s`; an engine
whose read fails shows no load and reads as unhealthy until one succeeds. Nobody
watching, nothing is asked of the engines.

It only reads: nothing here changes what the scheduler or the engines do. The
sampler is one task on the service's event loop, started and closed with the
service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from treadle.engines.base import EngineLoad
from treadle.errors import TreadleError
from treadle.runtime.driver import Runtime
from treadle.runtime.pool import EngineSlot
from treadle.service.jobs import Rollouts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    """The service over one interval ending at `at` (Unix seconds)."""

    at: float
    tokens_per_s: float
    finished_per_s: float
    running: int
    queued: int
    oldest_running_s: float  # the runtime's clock; 0.0 when none runs


@dataclass(frozen=True, slots=True)
class LoadReading:
    """An engine's latest load read: the load, or None when the read failed."""

    load: EngineLoad | None
    at: float  # Unix seconds


class Monitor:
    """See the module docstring. `runtimes` gives the service's engine pools (the
    policy's and the frozen one), `rollouts` its jobs and counters."""

    def __init__(self, rollouts: Rollouts, runtimes: Callable[[], Sequence[Runtime]], *,
                 interval_s: float = 1.0, keep: int = 600, watch_s: float = 30.0,
                 wall: Callable[[], float] = time.time) -> None:
        if not interval_s > 0 or keep < 2 or watch_s < 0:
            raise ValueError("interval_s must be > 0, keep >= 2 and watch_s >= 0")
        self.interval_s = interval_s
        self.watch_s = watch_s
        self._rollouts = rollouts
        self._runtimes = runtimes
        self._wall = wall
        self._samples: deque[Sample] = deque(maxlen=keep)
        self._loads: dict[str, LoadReading] = {}
        self._watched_until = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def watched(self) -> None:
        """Someone looks: read the engines' loads for the next `watch_s` seconds."""
        self._watched_until = self._wall() + self.watch_s

    def samples(self) -> list[Sample]:
        """The latest samples, oldest first."""
        return list(self._samples)

    def reading(self, engine_id: str) -> LoadReading | None:
        """The engine's latest load read (None: none yet)."""
        return self._loads.get(engine_id)

    def oldest_running_s(self) -> float:
        started = self._rollouts.running_since().values()
        now = self._rollouts.runtime.clock.now()
        return max(0.0, now - min(started)) if started else 0.0

    async def _run(self) -> None:
        tokens, finished, at = self._totals()
        while True:
            await asyncio.sleep(self.interval_s)
            if self._wall() < self._watched_until:
                await self._read_loads()
            new_tokens, new_finished, now = self._totals()
            span = max(now - at, 1e-9)
            self._samples.append(Sample(
                now, (new_tokens - tokens) / span, (new_finished - finished) / span,
                self._rollouts.live, self._rollouts.queued, self.oldest_running_s()))
            tokens, finished, at = new_tokens, new_finished, now

    def _totals(self) -> tuple[int, int, float]:
        metrics = self._rollouts.metrics
        return metrics.tokens, sum(metrics.finished.values()), self._wall()

    async def _read_loads(self) -> None:
        slots = [slot for rt in self._runtimes() for slot in rt.engines()]
        readings = await asyncio.gather(*(self._read(slot) for slot in slots))
        self._loads = {slot.engine_id: r for slot, r in zip(slots, readings, strict=True)}

    async def _read(self, slot: EngineSlot) -> LoadReading:
        try:
            async with asyncio.timeout(self.interval_s):
                load: EngineLoad | None = await slot.engine.load()
        except (TreadleError, TimeoutError) as e:
            log.debug("engine %s: its load could not be read: %s", slot.label, e)
            load = None
        return LoadReading(load, self._wall())


__all__ = ["LoadReading", "Monitor", "Sample"]

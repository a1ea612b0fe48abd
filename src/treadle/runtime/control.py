"""The runtime's control plane: the scheduler fed events, asked for decisions, timed.

`DecisionLoop` gives the scheduler (`core.scheduler.Scheduler`) each event at the
clock's time and, once per loop iteration after a burst of events, calls `decide`
and hands every decision to the runtime; when the scheduler asks to be woken
(`wakeup()`, periodic re-planning) it sleeps on the clock until then. The scheduler
runs synchronously on the event loop, so every call is timed into `ControlStats`:
a slow decision delays every trajectory.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from treadle.clock import Clock
from treadle.core.events import Decision, Event, TurnFinished
from treadle.core.scheduler import Scheduler

_CONTROL_SAMPLES = 200_000  # decision timings kept for percentiles


def _samples() -> deque[float]:
    return deque(maxlen=_CONTROL_SAMPLES)


@dataclass(slots=True)
class ControlStats:
    """What the control plane cost. One sample per `decide`: its CPU time plus the
    time of the `on_event` calls since the previous one (the scheduler's work for that
    instant: a turn's end, a tool's return, and whatever it set off). A decide is
    timed by the thread's CPU time, not wall time: on a loaded machine the operating
    system's own preemption would otherwise be counted as the scheduler's, and a
    re-plan takes milliseconds. An `on_event` call takes microseconds and is timed by
    the wall clock (`DecisionLoop.tell` says why). Samples in
    which the scheduler re-placed the whole batch (`Scheduler.replans` went up: at
    arrivals and periodically) are kept apart from the others, so that both costs
    are seen. Under load one decision covers the events of several turns, so each
    plain sample is also divided by the turns that ended in it (at least one) for
    the cost per turn. The latest `_CONTROL_SAMPLES` of each are kept."""

    plain: deque[float] = field(default_factory=_samples)  # decisions without a re-plan
    replans: deque[float] = field(default_factory=_samples)  # decisions with one
    per_turn: deque[float] = field(default_factory=_samples)  # plain ones / turns ended
    decisions: int = 0  # decide() calls
    events: int = 0  # on_event() calls
    max_live: int = 0  # most trajectories alive at once
    observer: Callable[[float], None] | None = None  # told every sample (e.g. metrics)

    def record(self, seconds: float, turns: int, replanned: bool) -> None:
        self.decisions += 1
        if self.observer is not None:
            self.observer(seconds)
        if replanned:
            self.replans.append(seconds)
        else:
            self.plain.append(seconds)
            self.per_turn.append(seconds / max(1, turns))

    def percentile_ms(self, q: float, which: str = "all") -> float:
        """The q-quantile (0-1) in milliseconds (0 with no samples) of "plain",
        "replans", "per_turn" or "all" (plain and replans together)."""
        samples = ([*self.plain, *self.replans] if which == "all"
                   else list(getattr(self, which)))
        if not samples:
            return 0.0
        samples.sort()
        return 1000.0 * samples[min(len(samples) - 1, int(q * len(samples)))]


class DecisionLoop:
    """Events in, decisions out, for one scheduler on one clock.

    `tell` must be called on the event loop; the decision it leads to runs in a
    later callback of the same iteration (`call_soon`), after the other events of
    the instant. `apply` gets each decision in order. `wanted` says whether a wake-up
    is worth planning (no trajectory alive: none is). After `close`, events are
    still given to the scheduler but nothing more is decided.
    """

    def __init__(self, scheduler: Scheduler, clock: Clock, stats: ControlStats,
                 apply: Callable[[Decision], None], wanted: Callable[[], bool]) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.stats = stats
        self._apply = apply
        self._wanted = wanted
        self._pending_control = 0.0  # CPU seconds of on_event since the last decide
        self._pending_turns = 0  # turns that ended since the last decide
        self._decide_soon = False  # a decide is scheduled for this iteration
        self._wake: asyncio.Task[None] | None = None  # sleeping until the scheduler's wakeup
        self._wake_at: float | None = None
        self._closed = False

    def tell(self, event: Event) -> None:
        # Wall time: an event's handling takes microseconds, and the thread's CPU clock
        # is a system call costing as much (3 us a read on the 2-core machine of
        # benchmarks/README.md: 2 reads an event, ~7 events a turn, were a tenth of the
        # service's CPU a turn). A preemption inside so short a window is rare.
        started = time.perf_counter()
        self.scheduler.on_event(event, self.clock.now())
        self._pending_control += time.perf_counter() - started
        self._pending_turns += isinstance(event, TurnFinished)
        self.stats.events += 1
        if not self._decide_soon and not self._closed:
            self._decide_soon = True
            asyncio.get_running_loop().call_soon(self.decide)

    def decide(self) -> None:
        """Ask the scheduler for its decisions now and carry them out."""
        self._decide_soon = False
        if self._closed:
            return
        replans = self.scheduler.replans
        started = time.thread_time()
        decisions = self.scheduler.decide(self.clock.now())
        self.stats.record(time.thread_time() - started + self._pending_control,
                          self._pending_turns, self.scheduler.replans != replans)
        self._pending_control, self._pending_turns = 0.0, 0
        for d in decisions:
            self._apply(d)
        self._plan_wakeup()

    def close(self) -> None:
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()

    def _plan_wakeup(self) -> None:
        wake = self.scheduler.wakeup()
        if wake is None or not self._wanted():
            return
        if self._wake is not None and self._wake_at is not None and self._wake_at <= wake:
            return
        if self._wake is not None:
            self._wake.cancel()
        self._wake_at = wake
        self._wake = asyncio.get_running_loop().create_task(self._woken_at(wake))

    async def _woken_at(self, wake: float) -> None:
        await self.clock.sleep(wake - self.clock.now())
        self._wake = self._wake_at = None
        if not self._decide_soon:
            self.decide()

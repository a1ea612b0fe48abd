"""A minimal discrete-event kernel.

Callbacks are scheduled at absolute simulated times. Ties are broken first by an
explicit `order` (lower first), then by scheduling order, so the same program
produces the same event sequence on every run and every machine. A scheduled call
can be cancelled through its handle; cancelled entries are skipped lazily, which
keeps rescheduling O(log n).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Handle:
    """A scheduled call; `cancel()` makes the kernel skip it."""

    time: float  # when it fires
    cancelled: bool = field(default=False)  # set by cancel()

    def cancel(self) -> None:
        self.cancelled = True


class Kernel:
    """Runs callbacks in (time, order, sequence) order on a simulated clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Handle, Callable[[], None]]] = []
        self._seq = 0
        self.fired = 0  # callbacks run so far
        self.stopped = False  # set by stop(): run() returns before the next callback

    def at(self, time: float, fn: Callable[[], None], order: int = 0) -> Handle:
        """Run `fn` at `time` (not before now)."""
        if not time >= self.now:  # also rejects NaN, which would corrupt the heap order
            raise ValueError(f"cannot schedule at {time}, in the past or not a time "
                             f"(now is {self.now})")
        self._seq += 1
        h = Handle(time)
        heapq.heappush(self._heap, (time, order, self._seq, h, fn))
        return h

    def after(self, delay: float, fn: Callable[[], None], order: int = 0) -> Handle:
        return self.at(self.now + max(0.0, delay), fn, order)

    def peek(self) -> float | None:
        """Time of the next live callback, or None when nothing is scheduled."""
        while self._heap and self._heap[0][3].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def step(self) -> bool:
        """Run the next live callback; False when nothing is left."""
        while self._heap:
            time, _, _, h, fn = heapq.heappop(self._heap)
            if h.cancelled:
                continue
            self.now = time
            self.fired += 1
            fn()
            return True
        return False

    def stop(self) -> None:
        """End `run` after the callback now running; what is scheduled stays."""
        self.stopped = True

    def run(self, until: float | None = None, max_events: int | None = None) -> None:
        """Run until nothing is scheduled, the clock would pass `until`, `stop` is
        called, or `max_events` callbacks have fired (a guard against runaway
        programs)."""
        fired = 0
        while not self.stopped:
            nxt = self.peek()
            if nxt is None or (until is not None and nxt > until):
                return
            if max_events is not None and fired >= max_events:
                raise RuntimeError(f"simulation exceeded {max_events} events at t={self.now:.3f}")
            self.step()
            fired += 1

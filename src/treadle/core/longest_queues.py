"""The engines whose queues could give a turn away, longest queue first.

Work stealing (`Progressive._steal`) moves the head of the longest queue to an idle
engine, as long as that queue holds more than one turn. Finding that queue by
looking at every engine cost each decision O(engines): at 1,024 engines, more than
half of a 100,000-trajectory batch's scheduling time (`bench control-plane`).
`LongestQueues` keeps the answer in a heap instead, updated lazily, so a decision
that steals nothing costs O(1) and a steal O(log engines) amortised.

The invariant: every live engine whose queue holds two turns or more has an entry
that records at least its queue's length now. Its owner keeps it by calling `grew`
whenever a turn joins a queue, and `reset` whenever engines join, leave or change
order; a queue that shrinks needs no call, since its entries then record more than
it holds, and `longest` corrects such an entry when it reaches the top. An entry is
believed only if it records the queue's length exactly, on an engine not draining.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from treadle.core.scheduler import EngineState

# Below this many turns a queue gives nothing away: its head runs next where it is.
MIN_DONOR = 2

_Entry = tuple[int, int, EngineState]  # (-queue length, -rank, engine)


class LongestQueues:
    """The live engine with the longest queue of at least `MIN_DONOR` turns; ties go
    to the engine later in id order (the larger rank). Pure: no I/O, no clock."""

    __slots__ = ("_engines", "_heap", "_rank")

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._rank: dict[str, int] = {}  # engine id -> its place in id order
        self._engines: list[EngineState] = []

    def __contains__(self, engine_id: object) -> bool:
        """Whether `reset` indexed the engine."""
        return engine_id in self._rank

    def reset(self, engines: Iterable[EngineState]) -> None:
        """Index `engines` (in id order) afresh: after engines join, leave or reorder."""
        self._engines = list(engines)
        self._rank = {e.engine_id: i for i, e in enumerate(self._engines)}
        self._heap = [(-len(e.queue), -i, e) for i, e in enumerate(self._engines)
                      if len(e.queue) >= MIN_DONOR and not e.draining]
        heapq.heapify(self._heap)

    def grew(self, e: EngineState) -> None:
        """A turn joined `e`'s queue (an engine `reset` has indexed)."""
        n = len(e.queue)
        if n >= MIN_DONOR:
            heapq.heappush(self._heap, (-n, -self._rank[e.engine_id], e))
            # Entries left behind by queues that grew again pile up: past twice one an
            # engine, index afresh (amortised O(1) a push).
            if len(self._heap) > 2 * len(self._engines) + 16:
                self.reset(self._engines)

    def longest(self) -> EngineState | None:
        """The engine with the longest queue of at least `MIN_DONOR` turns, or None."""
        heap = self._heap
        while heap:
            recorded, neg_rank, e = heap[0]
            n = len(e.queue)
            if -recorded == n and not e.draining:
                return e
            # Stale: the queue shrank (record it as it is now, if it still counts), or
            # grew (a later entry records that), or the engine drains.
            if n >= MIN_DONOR and n < -recorded and not e.draining:
                heapq.heapreplace(heap, (-n, neg_rank, e))
            else:
                heapq.heappop(heap)
        return None

"""One engine's queue of ready turns, as the scheduler keeps it.

`TurnQueue` orders turns by (priority, sequence number): lower priority first, then
first come, first served, so every run is deterministic. A trajectory is in at most
one entry; `discard` takes it out in O(1) and `push` replaces an entry it has.
Entries taken out stay in the heap until they reach its top and are dropped there
(lazy deletion); `len`, `peek`, `pop` and `drain` see live entries only, so no caller
needs to know that rule. (vLLM's `v1/core/sched/request_queue.py` gives its
scheduler the same kind of interface.)
"""

from __future__ import annotations

import heapq

Entry = tuple[float, int, str]  # (priority, sequence number, trajectory id)


class TurnQueue:
    """Queued turns of one engine, lowest (priority, seq) first."""

    __slots__ = ("_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[Entry] = []  # live entries and ones taken out since
        self._live: dict[str, int] = {}  # trajectory -> seq of its live entry

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, traj_id: object) -> bool:
        return traj_id in self._live

    def push(self, priority: float, seq: int, traj_id: str) -> None:
        """Queue the trajectory's turn (replacing an entry it has)."""
        self._live[traj_id] = seq
        heapq.heappush(self._heap, (priority, seq, traj_id))

    def peek(self) -> Entry | None:
        """The first live entry, or None."""
        heap = self._heap
        while heap and self._live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)  # taken out earlier, or replaced
        return heap[0] if heap else None

    def pop(self) -> Entry | None:
        """Take out the first live entry and return it, or None."""
        head = self.peek()
        if head is not None:
            heapq.heappop(self._heap)
            del self._live[head[2]]
        return head

    def pop_peeked(self) -> None:
        """Take out the entry `peek` has just returned (nothing changed the queue
        since): `pop` without looking for it again."""
        del self._live[heapq.heappop(self._heap)[2]]

    def discard(self, traj_id: str) -> bool:
        """Take the trajectory's entry out; False if it had none."""
        return self._live.pop(traj_id, None) is not None

    def drain(self) -> list[Entry]:
        """Take out every live entry; they come in queue order."""
        entries = sorted(e for e in self._heap if self._live.get(e[2]) == e[1])
        self._heap.clear()
        self._live.clear()
        return entries

"""`BatchOrder`: a runner actor's batches applied in the order the service sent them.

    order = BatchOrder(apply)       # apply(batch) carries one batch out
    order.arrive(2, second)         # early: kept until batch 1 is in
    order.arrive(1, first)          # applies first, then second

The service numbers every batch it sends a runner actor (an exchange's or a side
push's, `runtime.runner_channel`) from one counter, 1, 2, 3, ...; two calls of an
asyncio Ray actor may start in either order, so the actor cannot take arrival for
sending order. One invariant: batches are applied in sequence order, each once. A
batch that arrives before the one it follows is kept until the gap is filled; a
sequence number applied or kept already is the sender's bug, and raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

_B = TypeVar("_B")


class BatchOrder(Generic[_B]):
    """Batches numbered from 1, handed to `apply` in that order, each once (module
    docstring)."""

    def __init__(self, apply: Callable[[_B], None]) -> None:
        self._apply = apply
        self._next = 1  # the sequence number of the next batch to apply
        self._early: dict[int, _B] = {}  # arrived ahead of `_next`: kept until their turn

    @property
    def waiting(self) -> int:
        """Batches arrived early, kept until the ones before them are in."""
        return len(self._early)

    def arrive(self, seq: int, batch: _B) -> None:
        """Batch `seq` is in: it, and every early one it was the gap before, are applied
        now, in order; or it is kept until its turn. A number already applied or kept
        (or below 1) raises `RuntimeError`: a bug of the sender, and applying it would
        apply its messages twice."""
        if seq < self._next or seq in self._early:
            raise RuntimeError(f"batch {seq} arrived again (applied up to "
                               f"{self._next - 1}, kept early: {sorted(self._early)})")
        self._early[seq] = batch
        while self._next in self._early:
            ready = self._early.pop(self._next)
            # Counted before it is applied: one that raises part-way is not applied again.
            self._next += 1
            self._apply(ready)


__all__ = ["BatchOrder"]

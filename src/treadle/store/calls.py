"""A batch of store calls as data, and running one where the store is: `run_batch`.

    calls = [StoreCall("start", ("job-1", "t0")), StoreCall("finish", ("job-1", traj))]
    outcomes = run_batch(store, calls, grouped=True)  # [(True, 0), (True, Finish(...))]

`AsyncStore` queues its callers' calls and hands them over a batch at a time. A call
names a public `Store` method and its arguments, so a batch can cross into a process
of the store's own (`treadle.store.process.StoreProcess`) as well as run on a thread
beside the caller (`treadle.store.aio.StoreThread`): both are
a `StoreSide`.

Contracts (`run_batch`):

- Outcomes come back in the calls' order, one each: ``(True, result)`` or
  ``(False, exception)``. A call that raises fails alone: grouped, each call is a
  savepoint of the batch's one transaction (`treadle.store.transactions`), so its
  writes are undone and the others' kept.
- ``grouped`` commits the calls together, once, at the end; that commit failing
  fails every call that had not failed on its own, with the commit's error. Not
  grouped, each call is its own transaction.
- `local` calls (any callable, not a store method) run in the store's process only
  when that is the caller's: tests use them to hold the store's thread or to act on
  its connection. A `StoreProcess` refuses them (TypeError, that call alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Outcome = tuple[bool, Any]  # (True, the call's result) | (False, what it raised)


@dataclass(frozen=True, slots=True)
class StoreCall:
    """One call of a batch: `Store.<method>(*args, **kwargs)`, or `local()`."""

    method: str  # a public Store method's name ("" with `local`)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Any other callable, run as it is where the store is in this process (module
    # docstring); never sent to another process.
    local: Callable[[], Any] | None = None


class StoreSide(Protocol):
    """Where `AsyncStore`'s batches run: a `StoreThread` (a `Store` on a thread of
    this process) or a `StoreProcess`."""

    async def run(self, calls: Sequence[StoreCall], grouped: bool) -> list[Outcome]:
        """`run_batch` there (module docstring): each call's outcome. Raises when the
        batch got no answer at all (the store closed, its process lost or not
        restarted, the await cancelled): then no call of it has one."""
        ...

    async def aclose(self) -> None: ...


class Batching(Protocol):
    """What `run_batch` needs of a store (a `Store`): calls that commit together."""

    def batch(self) -> contextlib.AbstractContextManager[None]: ...


def run_batch(store: Batching, calls: Sequence[StoreCall], grouped: bool) -> list[Outcome]:
    """Run `calls` on `store` (module docstring). Never raises: a failed commit is
    every call's outcome."""
    outcomes: list[Outcome] = []
    try:
        with store.batch() if grouped else contextlib.nullcontext():
            for call in calls:
                try:
                    outcomes.append((True, _target(store, call)()))
                except BaseException as e:  # the caller's to handle
                    outcomes.append((False, e))
    except BaseException as e:  # the commit failed: none of the batch stands
        # (a call that failed on its own keeps its own error)
        done = outcomes + [(True, None)] * (len(calls) - len(outcomes))
        return [(False, e if ok else value) for ok, value in done]
    return outcomes


def _target(store: Batching, call: StoreCall) -> Callable[[], Any]:
    if call.local is not None:
        return call.local
    if not call.method or call.method.startswith("_"):
        raise TypeError(f"not a store call: {call.method!r}")
    method: Callable[..., Any] = getattr(store, call.method)
    return lambda: method(*call.args, **call.kwargs)


__all__ = ["Outcome", "StoreCall", "StoreSide", "run_batch"]

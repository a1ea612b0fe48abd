"""`AsyncStore`: the store for asyncio code, its calls a batch at a time off the loop.

    astore = AsyncStore(Store("treadle.db"))         # SQLite on a worker thread
    astore = AsyncStore(StoreProcess("treadle.db"))  # in a process of its own
    result = await astore.finish(job_id, trajectory)
    async for delivery in astore.iter_results(job_id, after=cursor):
        ...
    await astore.aclose()

Every public `Store` method has an async twin here with the same parameters and
result (`Store.close` is `aclose`); `call` runs any other callable on the worker
thread (with a `Store` only).

SQLite calls block on disk, and a blocked event loop stalls every trajectory, so no
call runs on the loop. The calls are queued in the order they were made and run one
batch at a time, in that order, which is what gives results their completion order:
a batch is data (`treadle.store.calls`), run by the store's side (a `StoreSide`): a
`Store` on one dedicated worker thread (`StoreThread`), or a `StoreProcess`, whose
SQLite and record encoding then take none of this process's CPU. A task on the loop
of the first call queued hands the batches over, and ends when the queue is empty.

The calls made while a batch runs make the next batch, one `Store.batch`: each is
still atomic (one failing fails alone), and they commit together, once (group
commit: a busy service's many small calls, a trajectory's start and finish, the
journal's batches, share their commits). A call is answered only after its batch
has committed; the commit failing fails every call of the batch. With
`group_commit=False` each call commits on its own (`benchmarks/store_group_bench.py`
measures both).

Cancelling an awaiting task does not undo a call whose batch has begun: it runs to
its end and commits (a `finish` whose await was cancelled mid-way is stored, and a
repeat is reported as a duplicate). A call still queued when its await is cancelled
is dropped and never runs. Either way, repeating the call settles it. A
`StoreProcess` lost with a batch under way fails that batch's calls (its commit may
or may not have happened: repeating settles that too), but for `finish` and `start`,
which are made once more here (finishing is idempotent; a start again counts one
attempt more at worst). Once `aclose` has begun, a call is a StoreError.
An `AsyncStore` may be used from several event loops in turn (the loop that hands a
batch over must run until it is answered), not after `aclose`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeGuard, TypeVar

from treadle.store.calls import Outcome, StoreCall, StoreSide, run_batch
from treadle.store.db import Store
from treadle.store.errors import StoreError, StoreProcessLost
from treadle.store.jobs import (
    Delivery,
    Event,
    Finish,
    JobInfo,
    PlannedTrajectory,
    TakenGroup,
    TrainerKey,
    TrajectoryState,
)
from treadle.store.journal import Journaled, JournalResume, JournalRow, JournalWrite
from treadle.types import FailureStage, StaleChoice, Trajectory

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class _Queued:
    """A call queued, and where its outcome goes."""

    call: StoreCall
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class StoreThread:
    """A `StoreSide`: a `Store`'s batches on one worker thread of this process."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-store")

    async def run(self, calls: Sequence[StoreCall], grouped: bool) -> list[Outcome]:
        # Not cancelled with its await: a batch begun runs to its commit.
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, run_batch, self.store, calls, grouped)

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._worker, self.store.close)
        self._worker.shutdown(wait=True)


class AsyncStore:
    """Runs a store's calls a batch at a time. See the module docstring."""

    def __init__(self, store: Store | StoreSide, *, group_commit: bool = True) -> None:
        self.store = store  # as given: a Store, or a StoreProcess
        # The one place a synchronous store is told apart: it gets a thread to run on.
        self._side: StoreSide = StoreThread(store) if isinstance(store, Store) else store
        self.group_commit = group_commit  # False: each call commits on its own
        self._queued: collections.deque[_Queued] = collections.deque()
        self._drainer: asyncio.Task[None] | None = None  # running the batches (_mutex)
        self._closing = False  # aclose begun: no call more
        self._mutex = threading.Lock()

    async def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run `fn(*args, **kwargs)` on the worker, in the batch of the calls made while
        the one before ran (module docstring): with a `Store` only (a `StoreProcess`
        refuses it: TypeError); the store's own calls have twins."""
        answer: _T = await self._queue(StoreCall("", local=functools.partial(fn, *args,
                                                                             **kwargs)))
        return answer

    async def _call(self, method: Callable[Concatenate[Store, _P], _T], *args: _P.args,
                    **kwargs: _P.kwargs) -> _T:
        """`method` (a `Store` method: its name and arguments are what is sent)."""
        answer: _T = await self._queue(StoreCall(method.__name__, args, kwargs))
        return answer

    async def _queue(self, call: StoreCall) -> Any:
        if self._closing:
            raise StoreError("the store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._mutex:
            self._queued.append(_Queued(call, future, loop))
            if not _running(self._drainer):
                self._drainer = loop.create_task(self._drain())
        return await future

    async def _again(self, method: Callable[Concatenate[Store, _P], _T], *args: _P.args,
                     **kwargs: _P.kwargs) -> _T:
        """`_call`, made once more if the store's process was lost under it (whether
        it committed is unknown): for the calls that repeating settles."""
        try:
            return await self._call(method, *args, **kwargs)
        except StoreProcessLost:
            return await self._call(method, *args, **kwargs)

    async def _drain(self) -> None:
        """A task: run what is queued, a batch at a time, until nothing is."""
        me = asyncio.current_task()  # (its `finally` may run with no loop running)
        try:
            while True:
                with self._mutex:
                    # Dropped if its await was cancelled before it began (read across
                    # threads: at worst it runs, as a begun call does).
                    queued = [q for q in self._queued if not q.future.cancelled()]
                    empty = not self._queued
                    self._queued.clear()
                    if empty:
                        self._drainer = None
                        return
                if not queued:
                    continue
                # One call alone is its own transaction, as it would be without a batch.
                grouped = self.group_commit and len(queued) > 1
                try:
                    outcomes = await self._side.run([q.call for q in queued], grouped)
                except asyncio.CancelledError:  # this loop is closing: tell the others
                    _settle_all(queued, [(False, StoreError(
                        "the store's batch was cut off: the loop running it stopped"))]
                        * len(queued))
                    raise
                except Exception as e:  # the store's process lost: no answer for any
                    outcomes = [(False, e)] * len(queued)
                _settle_all(queued, outcomes)
        finally:
            # Cut off (its loop closing, or closed and the task collected): the calls
            # queued since, another loop's, get a drain on their own loop.
            with self._mutex:
                after = None
                if me is not None and self._drainer is me:
                    self._drainer = None
                    after = self._queued[0].loop if self._queued else None
            if after is not None and me is not None and after is not me.get_loop():
                with contextlib.suppress(RuntimeError):  # that loop closed too
                    after.call_soon_threadsafe(self._resume)

    def _resume(self) -> None:
        """On a queued call's loop: drain what is queued, unless a drain runs."""
        with self._mutex:
            if self._queued and not _running(self._drainer):
                self._drainer = asyncio.get_running_loop().create_task(self._drain())

    # -- Store's calls; see Store for what they do -------------------------------------

    async def create_job(self, job_id: str, spec: Mapping[str, Any],
                         planned: Sequence[PlannedTrajectory], *, owner: str | None = None,
                         continuous: bool = False) -> JobInfo:
        return await self._call(Store.create_job, job_id, spec, planned, owner=owner,
                               continuous=continuous)

    async def launch_group(self, job_id: str, group_id: str,
                           planned: Sequence[PlannedTrajectory], *, close: bool = False) -> None:
        await self._call(Store.launch_group, job_id, group_id, planned, close=close)

    async def close_plan(self, job_id: str) -> None:
        await self._call(Store.close_plan, job_id)

    async def groups_launched(self, job_id: str) -> tuple[int, int, int]:
        return await self._call(Store.groups_launched, job_id)

    async def take(self, job_id: str, take_id: str, n: int, min_fresh: int | None = None,
                   choice: StaleChoice = StaleChoice.FLAG) -> list[TakenGroup]:
        return await self._call(Store.take, job_id, take_id, n, min_fresh, choice)

    async def taken_groups(self, job_id: str, after: int = 0,
                           limit: int = 100) -> list[TakenGroup]:
        return await self._call(Store.taken_groups, job_id, after, limit)

    async def stale_members(self, job_id: str, min_fresh: int) -> list[tuple[Delivery, int]]:
        return await self._call(Store.stale_members, job_id, min_fresh)

    async def restart(self, job_id: str, trajectory_id: str, new: PlannedTrajectory,
                      version: int, *, sampled: int = 0, reason: str = "stale: restarted"
                      ) -> int | None:
        return await self._call(Store.restart, job_id, trajectory_id, new, version,
                               sampled=sampled, reason=reason)

    async def add_trajectories(self, job_id: str,
                               planned: Sequence[PlannedTrajectory]) -> JobInfo:
        return await self._call(Store.add_trajectories, job_id, planned)

    async def job(self, job_id: str) -> JobInfo:
        return await self._call(Store.job, job_id)

    async def job_spec(self, job_id: str) -> dict[str, Any]:
        return await self._call(Store.job_spec, job_id)

    async def job_ids(self) -> list[str]:
        return await self._call(Store.job_ids)

    async def recent_jobs(self, limit: int, *, owner: str | None = None) -> list[JobInfo]:
        return await self._call(Store.recent_jobs, limit, owner=owner)

    async def unfinished_jobs(self) -> list[JobInfo]:
        return await self._call(Store.unfinished_jobs)

    async def recover(self) -> list[JobInfo]:
        return await self._call(Store.recover)

    async def cancel(self, job_id: str, reason: str = "cancelled") -> JobInfo:
        return await self._call(Store.cancel, job_id, reason)

    async def fail(self, job_id: str, reason: str,
                   stage: FailureStage = FailureStage.RUNTIME) -> JobInfo:
        return await self._call(Store.fail, job_id, reason, stage)

    async def delete_job(self, job_id: str) -> None:
        await self._call(Store.delete_job, job_id)

    async def start(self, job_id: str, trajectory_id: str) -> int | None:
        # Repeated after a lost process: at worst one more attempt counted.
        return await self._again(Store.start, job_id, trajectory_id)

    async def finish(self, job_id: str, trajectory: Trajectory) -> Finish:
        # Repeated after a lost process: finishing is idempotent (Store's contract).
        return await self._again(Store.finish, job_id, trajectory)

    async def results(self, job_id: str, after: int = 0, limit: int = 100) -> list[Delivery]:
        return await self._call(Store.results, job_id, after, limit)

    async def unfinished(self, job_id: str) -> list[TrajectoryState]:
        return await self._call(Store.unfinished, job_id)

    async def states(self, job_id: str) -> list[TrajectoryState]:
        return await self._call(Store.states, job_id)

    async def result(self, job_id: str, trajectory_id: str) -> Delivery | None:
        return await self._call(Store.result, job_id, trajectory_id)

    async def trajectory_state(self, job_id: str, trajectory_id: str) -> TrajectoryState:
        return await self._call(Store.trajectory_state, job_id, trajectory_id)

    async def add_event(self, job_id: str, kind: str, payload: Mapping[str, Any] | None = None,
                        trajectory_id: str | None = None) -> int:
        return await self._call(Store.add_event, job_id, kind, payload, trajectory_id)

    async def merged_events(self, job_id: str, kinds: Sequence[str]
                            ) -> dict[str, dict[str, Any]]:
        return await self._call(Store.merged_events, job_id, kinds)

    async def events(self, job_id: str, after: int = 0, limit: int = 100) -> list[Event]:
        return await self._call(Store.events, job_id, after, limit)

    async def write_journal(self, entries: Sequence[JournalRow | JournalResume]
                            ) -> JournalWrite:
        return await self._call(Store.write_journal, entries)

    async def journaled(self, job_id: str, trajectory_id: str) -> Journaled:
        return await self._call(Store.journaled, job_id, trajectory_id)

    async def add_trainer_key(self, key_id: str, digest: str, trainer_run: str) -> TrainerKey:
        return await self._call(Store.add_trainer_key, key_id, digest, trainer_run)

    async def trainer_keys(self) -> list[TrainerKey]:
        return await self._call(Store.trainer_keys)

    async def delete_trainer_key(self, key_id: str) -> None:
        await self._call(Store.delete_trainer_key, key_id)

    async def iter_results(self, job_id: str, after: int = 0,
                           page_size: int = 100) -> AsyncIterator[Delivery]:
        """Every result with seq > `after`, a page per call (memory: one page)."""
        while True:
            page = await self.results(job_id, after, page_size)
            for delivery in page:
                yield delivery
            if len(page) < page_size:
                return
            after = page[-1].seq

    async def aclose(self) -> None:
        """Refuse new calls, wait for those queued on this loop, then close the store."""
        self._closing = True
        drainer = self._drainer
        if _running(drainer) and drainer.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(Exception):
                await asyncio.shield(drainer)
        await self._side.aclose()


def _running(task: asyncio.Task[None] | None) -> TypeGuard[asyncio.Task[None]]:
    """A drain that will go on: not done, its loop not closed (a loop closed with the
    task pending leaves it so, never to run)."""
    return task is not None and not task.done() and not task.get_loop().is_closed()


def _settle_all(queued: list[_Queued], outcomes: list[Outcome]) -> None:
    """Each call's outcome to its future: at once on this loop, by one wake-up a loop
    on the others."""
    here = asyncio.get_running_loop()
    elsewhere: dict[asyncio.AbstractEventLoop, list[tuple[_Queued, bool, Any]]] = {}
    for q, (ok, value) in zip(queued, outcomes, strict=True):
        if q.loop is here:
            _settle([(q, ok, value)])
        else:
            elsewhere.setdefault(q.loop, []).append((q, ok, value))
    for loop, answers in elsewhere.items():
        with contextlib.suppress(RuntimeError):  # its loop closed: no one waits
            loop.call_soon_threadsafe(_settle, answers)


def _settle(answers: list[tuple[_Queued, bool, Any]]) -> None:
    """On a caller's loop: each call's outcome to its future (unless cancelled)."""
    for queued, ok, value in answers:
        if queued.future.done():
            continue
        if ok:
            queued.future.set_result(value)
        else:
            queued.future.set_exception(value)

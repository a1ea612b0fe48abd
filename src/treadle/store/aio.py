"""`AsyncStore`: the store for asyncio code, its calls on one worker thread.

    astore = AsyncStore(Store("treadle.db"))
    result = await astore.call(astore.store.finish, job_id, trajectory)
    async for delivery in astore.iter_results(job_id, after=cursor):
        ...
    await astore.aclose()

SQLite calls block on disk, and a blocked event loop stalls every trajectory, so
every call runs on a single dedicated thread: calls run one at a time, in the order
they were made, and never on the loop. One thread (not a pool) keeps the order
equal to the call order, which is what gives results their completion order.

Cancelling an awaiting task does not undo a call the worker has begun: it runs to
its end and commits (a `finish` whose await was cancelled mid-way is stored, and a
repeat is reported as a duplicate). A call still queued behind others when its await
is cancelled is dropped and never runs. Either way, repeating the call settles it.
An `AsyncStore` may be used from several event loops in turn, not after `aclose`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from treadle.store.db import Store
from treadle.store.jobs import Delivery

_P = ParamSpec("_P")
_T = TypeVar("_T")


class AsyncStore:
    """Runs a `Store`'s calls on one worker thread. See the module docstring."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treadle-store")

    async def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run `fn(*args, **kwargs)` (usually a method of `self.store`) on the worker."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, functools.partial(fn, *args, **kwargs))

    async def iter_results(self, job_id: str, after: int = 0,
                           page_size: int = 100) -> AsyncIterator[Delivery]:
        """Every result with seq > `after`, a page per worker call (memory: one page)."""
        while True:
            page = await self.call(self.store.results, job_id, after, page_size)
            for delivery in page:
                yield delivery
            if len(page) < page_size:
                return
            after = page[-1].seq

    async def aclose(self) -> None:
        """Wait for calls in progress, then close the store."""
        await self.call(self.store.close)
        self._worker.shutdown(wait=True)

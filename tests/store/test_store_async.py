"""AsyncStore: calls run on one worker thread, never on the event loop, in call order."""

from __future__ import annotations

import asyncio
import inspect
import random
import threading
from pathlib import Path

from store_helpers import plan, random_trajectory

from treadle.store import AsyncStore, JobStatus, Store
from treadle.types import FailureStage, TrajectoryStatus


def _run(coro: object) -> object:
    async def bounded() -> object:
        return await asyncio.wait_for(coro, timeout=60)  # type: ignore[arg-type]
    return asyncio.run(bounded())


def test_concurrent_finishes_from_tasks_get_dense_seqs_in_call_order(tmp_path: Path) -> None:
    planned = plan(16, 16)
    rng = random.Random(11)
    results = [random_trajectory(rng, p, TrajectoryStatus.COMPLETED) for p in planned]

    async def main() -> list[int]:
        astore = AsyncStore(Store(tmp_path / "a.db"))
        await astore.create_job("j", {"n": 16}, planned)
        # gather starts the calls in list order; one worker thread keeps that order.
        finishes = await asyncio.gather(*(astore.finish("j", t) for t in results))
        seqs = [f.seq for f in finishes]
        streamed = [d.trajectory_id async for d in astore.iter_results("j", page_size=7)]
        assert streamed == [t.trajectory_id for t in results]
        info = await astore.job("j")
        assert info.status is JobStatus.COMPLETED
        await astore.aclose()
        return seqs

    assert _run(main()) == list(range(1, 257))


def test_calls_run_on_one_thread_that_is_not_the_loop() -> None:
    seen: list[int] = []

    def where() -> int:
        seen.append(threading.get_ident())
        return threading.get_ident()

    async def main() -> None:
        astore = AsyncStore(Store(":memory:"))
        loop_thread = threading.get_ident()
        await asyncio.gather(*(astore.call(where) for _ in range(50)))
        assert len(set(seen)) == 1 and seen[0] != loop_thread
        await astore.aclose()

    _run(main())


def test_the_loop_keeps_running_while_a_call_blocks() -> None:
    release = threading.Event()
    ticks: list[int] = []

    async def main() -> None:
        astore = AsyncStore(Store(":memory:"))
        blocked = asyncio.ensure_future(astore.call(release.wait, 30))
        for i in range(5):  # the loop is free: these run while the worker is blocked
            ticks.append(i)
            await asyncio.sleep(0)
        assert not blocked.done()
        release.set()
        assert await blocked is True
        await astore.aclose()

    _run(main())
    assert ticks == [0, 1, 2, 3, 4]


class BlockingClock:
    """A clock whose next reading waits for `gate`: it holds a call mid-way on the worker."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.block = False

    def __call__(self) -> float:
        if self.block:
            self.entered.set()
            self.gate.wait(30)
        return 1000.0


def test_a_cancelled_await_of_a_started_call_still_commits() -> None:
    p = plan(1, 1)
    t = random_trajectory(random.Random(1), p[0], TrajectoryStatus.COMPLETED)
    clock = BlockingClock()

    async def main() -> None:
        store = Store(":memory:", clock=clock)
        astore = AsyncStore(store)
        await astore.call(store.create_job, "j", {}, p)
        clock.block = True
        finishing = asyncio.ensure_future(astore.call(store.finish, "j", t))
        await asyncio.to_thread(clock.entered.wait, 30)  # the worker is inside finish
        finishing.cancel()
        clock.block = False
        clock.gate.set()
        info = await astore.call(store.job, "j")
        assert finishing.cancelled() and info.delivered == 1
        again = await astore.call(store.finish, "j", t)
        assert again.duplicate and again.seq == 1
        await astore.aclose()

    _run(main())


def test_a_cancelled_await_of_a_queued_call_drops_it() -> None:
    gate = threading.Event()
    p = plan(1, 1)
    t = random_trajectory(random.Random(1), p[0], TrajectoryStatus.COMPLETED)

    async def main() -> None:
        store = Store(":memory:")
        astore = AsyncStore(store)
        await astore.call(store.create_job, "j", {}, p)
        blocker = asyncio.ensure_future(astore.call(gate.wait, 30))
        finishing = asyncio.ensure_future(astore.call(store.finish, "j", t))
        await asyncio.sleep(0)  # both submitted; finish waits behind the blocker
        finishing.cancel()
        await asyncio.sleep(0)  # the cancel reaches the worker's queue before it is free
        gate.set()
        await blocker
        assert (await astore.call(store.job, "j")).delivered == 0
        assert not (await astore.call(store.finish, "j", t)).duplicate  # a retry delivers it
        await astore.aclose()

    _run(main())


def test_every_store_call_has_an_async_twin_with_its_signature() -> None:
    public = [name for name, fn in inspect.getmembers(Store, inspect.isfunction)
              if not name.startswith("_") and name not in ("close", "batch")]
    for name in public:
        twin = getattr(AsyncStore, name, None)
        assert twin is not None, f"AsyncStore has no {name}"
        want, got = inspect.signature(getattr(Store, name)), inspect.signature(twin)
        assert got.parameters == want.parameters, name
        if name == "iter_results":
            assert inspect.isasyncgenfunction(twin)
        else:
            assert inspect.iscoroutinefunction(twin), name
            assert got.return_annotation == want.return_annotation, name


def test_the_async_twins_run_a_job_through(tmp_path: Path) -> None:
    planned = plan(2, 3)
    rng = random.Random(5)

    async def main() -> None:
        astore = AsyncStore(Store(tmp_path / "t.db"))
        info = await astore.create_job("j", {"n": 3}, planned)
        assert info.status is JobStatus.QUEUED
        assert await astore.job_spec("j") == {"n": 3}
        assert await astore.job_ids() == ["j"]
        assert await astore.start("j", planned[0].trajectory_id) == 0
        assert await astore.start("j", planned[1].trajectory_id) == 0
        done = random_trajectory(rng, planned[0], TrajectoryStatus.COMPLETED)
        finish = await astore.finish("j", done)
        assert (finish.seq, finish.duplicate) == (1, False)
        assert [j.job_id for j in await astore.unfinished_jobs()] == ["j"]
        assert [j.job_id for j in await astore.recover()] == ["j"]
        state = await astore.trajectory_state("j", planned[1].trajectory_id)
        assert state.status is TrajectoryStatus.PENDING and state.attempts == 1
        assert len(await astore.unfinished("j")) == 5
        event_id = await astore.add_event("j", "note", {"x": 1}, planned[1].trajectory_id)
        assert (await astore.events("j", after=event_id - 1))[0].payload == {"x": 1}
        assert (await astore.cancel("j", "enough")).counts[TrajectoryStatus.ABORTED] == 5
        assert [d.seq for d in await astore.results("j", after=2, limit=2)] == [3, 4]
        assert (await astore.fail("j", "late")).status is JobStatus.CANCELLED  # terminal
        await astore.create_job("k", {}, plan(1, 1, "k"))
        failed = await astore.fail("k", "engines lost", FailureStage.ENGINE)
        assert failed.counts[TrajectoryStatus.ERROR] == 1
        await astore.delete_job("k")
        assert await astore.job_ids() == ["j"]
        assert (await astore.job("j")).delivered == 6
        await astore.aclose()

    _run(main())

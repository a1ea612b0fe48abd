"""The clocks: the real ones' arithmetic, and `FakeClock`'s sleeps, timeouts and jumps."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from treadle.clock import MONOTONIC, ScaledClock, WallClock
from treadle.testing import FakeClock

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), 30)  # a hang fails; it is no timing

    return asyncio.run(bounded())


def test_a_scaled_clock_counts_modelled_seconds_from_its_origin() -> None:
    real = [100.0]
    clock = ScaledClock(0.05, monotonic=lambda: real[0])
    real[0] += 1.0
    assert clock.now() == pytest.approx(20.0)
    assert clock.real_seconds(20.0) == pytest.approx(1.0) and clock.real_seconds(-3) == 0.0
    assert WallClock(monotonic=lambda: real[0], origin=90.0).now() == pytest.approx(11.0)
    assert abs(MONOTONIC.now() - __import__("time").monotonic()) < 1.0
    with pytest.raises(ValueError):
        ScaledClock(0)


def test_a_real_clock_times_out_on_its_own_seconds() -> None:
    async def main() -> None:
        clock = ScaledClock(1e-3)  # a modelled hour takes 3.6 real seconds
        with pytest.raises(TimeoutError):
            async with clock.timeout(1.0):  # 1 ms real
                await asyncio.Event().wait()
        async with clock.timeout(None):
            await clock.sleep(0.5)

    run(main)


def test_sleeps_wake_in_time_order_only_when_advanced() -> None:
    async def main() -> list[tuple[str, float]]:
        clock = FakeClock(start=10.0)
        woke: list[tuple[str, float]] = []

        async def nap(name: str, seconds: float) -> None:
            await clock.sleep(seconds)
            woke.append((name, clock.now()))

        tasks = [asyncio.ensure_future(nap(n, s)) for n, s in (("b", 2.0), ("a", 1.0),
                                                                ("c", 2.0))]
        await asyncio.sleep(0)
        assert clock.pending == 3 and clock.next_deadline() == 11.0
        clock.advance(0.999)
        await asyncio.sleep(0)
        assert woke == []
        clock.advance(0.001)
        await asyncio.gather(tasks[1])
        assert woke == [("a", 11.0)]
        clock.advance(5.0)
        await asyncio.gather(*tasks)
        with pytest.raises(ValueError):
            clock.advance(-1)
        return woke

    assert run(main)[1:] == [("b", 16.0), ("c", 16.0)]  # ties in the order they were set


def test_a_fake_timeout_raises_timeout_error_at_its_deadline_and_not_before() -> None:
    async def main() -> None:
        clock = FakeClock()
        gate = asyncio.Event()

        async def waits() -> str:
            async with clock.timeout(5.0):
                await gate.wait()
            return "in time"

        late = asyncio.ensure_future(waits())
        await asyncio.sleep(0)
        clock.advance(4.9)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not late.done()
        clock.advance(0.1)
        with pytest.raises(TimeoutError):
            await late
        on_time = asyncio.ensure_future(waits())
        await asyncio.sleep(0)
        gate.set()
        assert await on_time == "in time"
        assert clock.pending == 0  # the unfired deadline was dropped with its block
        with pytest.raises(TimeoutError):
            async with clock.timeout(0):
                await asyncio.sleep(0)

    run(main)


def test_a_cancelled_sleep_leaves_no_timer_and_cancellation_is_not_a_timeout() -> None:
    async def main() -> None:
        clock = FakeClock()
        napping = asyncio.ensure_future(clock.sleep(3.0))
        await asyncio.sleep(0)
        napping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await napping
        assert clock.pending == 0

        async def guarded() -> None:
            async with clock.timeout(10.0):
                await asyncio.Event().wait()

        task = asyncio.ensure_future(guarded())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main)


def test_autojump_plays_out_a_chain_of_waits_exactly_and_at_once() -> None:
    async def main() -> list[tuple[str, float]]:
        clock = FakeClock(autojump=True)
        log: list[tuple[str, float]] = []

        async def worker(name: str, period: float, n: int) -> None:
            for _ in range(n):
                await clock.sleep(period)
                log.append((name, clock.now()))

        async def deadline() -> None:
            try:
                async with clock.timeout(2.5):
                    await asyncio.Event().wait()
            except TimeoutError:
                log.append(("timeout", clock.now()))

        await asyncio.gather(worker("fast", 1.0, 3), worker("slow", 1.5, 2), deadline())
        return log

    # At 3.0 both are due; slow's sleep was set first (at 1.5, fast's at 2.0).
    assert run(main) == [("fast", 1.0), ("slow", 1.5), ("fast", 2.0), ("timeout", 2.5),
                         ("slow", 3.0), ("fast", 3.0)]

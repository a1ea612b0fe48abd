"""CallPacer: a runner stream's calls at once after a quiet spell, `gap_s` apart under
load (on a fake clock: no real time passes)."""

from __future__ import annotations

import asyncio

import pytest

from treadle.runtime.call_pacer import CallPacer
from treadle.testing import FakeClock


def test_calls_go_at_once_when_quiet_and_a_gap_apart_when_busy() -> None:
    async def main() -> None:
        clock = FakeClock(100.0)
        pacer = CallPacer(0.03, clock)
        await asyncio.wait_for(pacer.wait(), timeout=60)  # the first: no wait (a loop turn)
        assert clock.now() == 100.0
        second = asyncio.ensure_future(pacer.wait())  # at once after: the gap's rest
        for _ in range(3):
            await asyncio.sleep(0)
        assert not second.done()
        clock.advance(0.02)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not second.done()
        clock.advance(0.01)
        await second  # 30 ms after the first
        clock.advance(5.0)  # a quiet spell: the next goes at once again
        await asyncio.wait_for(pacer.wait(), timeout=60)
        assert clock.now() == pytest.approx(105.03)

    asyncio.run(main())


def test_a_negative_gap_is_refused() -> None:
    with pytest.raises(ValueError):
        CallPacer(-1.0)

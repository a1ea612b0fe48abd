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
        asked = asyncio.Event()

        async def second() -> None:  # at once after the first: the gap's rest
            asked.set()
            await pacer.wait()  # runs in this step up to its sleep: its timer is set
        task = asyncio.ensure_future(second())
        await asked.wait()
        assert clock.next_deadline() == pytest.approx(100.03) and not task.done()
        clock.advance(0.02)
        assert clock.next_deadline() == pytest.approx(100.03)  # not yet due
        clock.advance(0.01)
        await task  # 30 ms after the first
        clock.advance(5.0)  # a quiet spell: the next goes at once again
        await asyncio.wait_for(pacer.wait(), timeout=60)
        assert clock.now() == pytest.approx(105.03)

    asyncio.run(main())


def test_a_negative_gap_is_refused() -> None:
    with pytest.raises(ValueError):
        CallPacer(-1.0)

"""One engine crash must not fail a batch: the grace for capacity to come back, on a
fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from runtime_helpers import FakeEngine

from treadle.core.policies.baselines import Slime
from treadle.engines.errors import NoEngineAvailable
from treadle.runtime.driver import Runtime
from treadle.runtime.replay import ReplayResult, replay
from treadle.testing import FakeClock
from treadle.workloads import TrajectorySpec, TurnSpec

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), timeout_s)  # a hang fails; it is no timing

    return asyncio.run(bounded())


def spec(tid: str, *turns: int) -> TrajectorySpec:
    shapes = [TurnSpec(n, 0.5, 5) for n in turns[:-1]] + [TurnSpec(turns[-1], 0.0, 0)]
    return TrajectorySpec(tid, f"g-{tid}", 16, tuple(shapes))


async def replay_timed(s: TrajectorySpec, rt: Runtime) -> ReplayResult | tuple[float, Exception]:
    """The replay's result, or (clock time, error) when it raised."""
    try:
        return await replay(s, rt.turns(s.traj_id, s.group_id), rt.clock)
    except Exception as e:
        return rt.clock.now(), e


def test_a_replacement_registered_within_the_grace_runs_every_trajectory() -> None:
    """The crash of the only engine, a replacement 0.7 s later: nothing fails."""
    clock = FakeClock(autojump=True)
    first, second = FakeEngine("first", clock), FakeEngine("second", clock)
    specs = [spec(f"t{i}", 400, 300) for i in range(32)]

    async def main() -> list[Any]:
        rt = Runtime(Slime(4, 1), clock=clock, engine_wait_s=60.0)
        rt.register_engine(first, tp=4, label="first")
        await rt.start()
        jobs = [asyncio.ensure_future(replay_timed(s, rt)) for s in specs]
        await clock.sleep(0.1)
        first.kill()
        await clock.sleep(0.7)
        rt.register_engine(second, tp=4, label="second")
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out

    out = run(main)
    assert [getattr(r, "output_tokens", r) for r in out] == [700] * 32
    assert {r.request_id.split(":")[0] for r in second.requests} == {s.traj_id for s in specs}


def test_with_no_replacement_waiting_turns_fail_exactly_after_the_grace() -> None:
    clock = FakeClock(autojump=True)
    engine = FakeEngine("only", clock)

    async def main() -> list[Any]:
        rt = Runtime(Slime(1, 1), clock=clock, engine_wait_s=30.0)
        rt.register_engine(engine, label="only")
        await rt.start()
        jobs = [asyncio.ensure_future(replay_timed(spec(f"t{i}", 400, 300), rt))
                for i in range(8)]
        await clock.sleep(0.1)
        engine.kill()
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out

    out = run(main)
    # Every turn was generating at the kill: each fails 30 s after it, to the instant.
    assert [when for when, _ in out] == pytest.approx([30.1] * 8)
    assert all(isinstance(e, NoEngineAvailable) and "only: EngineUnavailable" in str(e)
               for _, e in out)

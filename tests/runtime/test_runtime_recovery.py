"""One engine crash must not fail a batch: the grace for capacity to come back, and
the launcher's replacement of a failed engine (bounded, backed off), on a fake clock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from runtime_helpers import FakeEngine, FakeLauncher

from treadle.agent.runner import Sampling
from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.core.policies.baselines import Slime
from treadle.engines.errors import NoEngineAvailable
from treadle.runtime.driver import RelaunchPolicy, Runtime
from treadle.runtime.replay import ReplayResult, replay
from treadle.testing import FakeClock
from treadle.workloads import TrajectorySpec, TurnSpec, generate

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


def test_the_launcher_relaunches_a_failed_engine_on_its_gpus() -> None:
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock, startup_s=2.0)
    specs = [spec(f"t{i}", 400, 300) for i in range(16)]

    async def main() -> tuple[list[Any], Runtime]:
        rt = Runtime(Slime(4, 1), launcher=launcher, gpus=4, clock=clock)
        await rt.start()  # one TP-4 engine, up at 2.0
        jobs = [asyncio.ensure_future(replay_timed(s, rt)) for s in specs]
        await clock.sleep(0.1)
        launcher.started[0].kill()
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out, rt

    out, rt = run(main)
    assert [getattr(r, "output_tokens", r) for r in out] == [700] * 16
    # Stopped at the kill (2.1), backed off 1 s, started at 3.1, up at 5.1.
    assert launcher.starts == pytest.approx([0.0, 3.1]) and launcher.stopped[0] == "launched-0"
    assert rt.pool.relaunched == 1
    assert [(s.label, s.tp) for s in rt.engines()] == [("launched-1", 4)]
    second = launcher.started[1]
    assert {r.request_id.split(":")[0] for r in second.requests} == {s.traj_id for s in specs}
    assert all(isinstance(r, ReplayResult) and r.finished_at > 5.1 for r in out)


def test_a_replacement_that_keeps_dying_is_relaunched_a_bounded_number_of_times(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every replacement dies at its first call: three relaunches, backed off 1, 2 and
    4 s, then none; the waiting turns fail a grace after the last one died."""
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock, startup_s=2.0, doomed=1)

    async def main() -> list[Any]:
        rt = Runtime(Slime(1, 1), launcher=launcher, gpus=1, clock=clock, engine_wait_s=60.0)
        await rt.start()
        jobs = [asyncio.ensure_future(replay_timed(spec(f"t{i}", 400), rt)) for i in range(4)]
        await clock.sleep(0.1)
        launcher.started[0].kill()
        out = await asyncio.gather(*jobs)
        await clock.sleep(100.0)  # nothing more is started, however long it waits
        await rt.close()
        return out

    with caplog.at_level(logging.WARNING, logger="treadle.runtime.pool"):
        out = run(main)
    # Killed at 2.1; attempt n starts 2^(n-1) s after the previous one died, and each
    # replacement is up 2 s after its start and dies at once.
    assert launcher.starts == pytest.approx([0.0, 3.1, 7.1, 13.1])
    assert [when for when, _ in out] == pytest.approx([15.1 + 60.0] * 4)
    assert all(isinstance(e, NoEngineAvailable) for _, e in out)
    assert "after 3 replacements in a row; not relaunching" in caplog.text


def test_failed_starts_count_against_the_attempts_and_the_grace_still_ends() -> None:
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock, startup_s=2.0, refuse=1)

    async def main() -> list[Any]:
        rt = Runtime(Slime(1, 1), launcher=launcher, gpus=1, clock=clock, engine_wait_s=60.0)
        await rt.start()
        jobs = [asyncio.ensure_future(replay_timed(spec(f"t{i}", 400), rt)) for i in range(4)]
        await clock.sleep(0.1)
        launcher.started[0].kill()
        return await asyncio.gather(*jobs)

    out = run(main)
    assert launcher.starts == pytest.approx([0.0, 3.1, 7.1, 13.1])  # refused after 2 s each
    assert [when for when, _ in out] == pytest.approx([62.1] * 4)  # the grace, from the kill


def test_a_relaunch_under_way_outlasts_a_short_grace() -> None:
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock, startup_s=2.0)

    async def main() -> list[Any]:
        rt = Runtime(Slime(1, 1), launcher=launcher, gpus=1, clock=clock, engine_wait_s=0.5)
        await rt.start()
        jobs = [asyncio.ensure_future(replay_timed(spec(f"t{i}", 400), rt)) for i in range(4)]
        await clock.sleep(0.1)
        launcher.started[0].kill()
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out

    assert [getattr(r, "output_tokens", r) for r in run(main)] == [400] * 4


def test_a_line_that_stayed_up_starts_its_count_afresh() -> None:
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock, startup_s=2.0)
    policy = RelaunchPolicy(attempts=1, backoff_s=1.0, reset_after_s=100.0)

    async def main() -> None:
        rt = Runtime(Slime(1, 1), launcher=launcher, gpus=1, clock=clock, relaunch=policy)
        await rt.start()
        for n in (1, 2):  # each replacement lived 200 s: a new line each time
            await clock.sleep(200.0)
            launcher.started[-1].kill()
            await rt.turns(f"probe{n}", "g").generate([1], 1, Sampling(), [])
            assert len(launcher.started) == n + 1
        await clock.sleep(10.0)  # this one dies young: its line's one attempt is spent
        launcher.started[-1].kill()
        await clock.sleep(20.0)  # two health checks missed: failed, and not replaced
        assert len(launcher.starts) == 3 and rt.engines() == [] and not rt.has_engines()
        await rt.close()

    run(main)


def test_removed_and_drained_engines_are_not_replaced() -> None:
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock)

    async def main() -> None:
        rt = Runtime(Slime(1, 1), launcher=launcher, gpus=2, clock=clock)
        await rt.start()
        first, second = (s.engine_id for s in rt.engines())
        rt.remove_engine(first)
        rt.drain_engine(second)
        await clock.sleep(60.0)
        assert len(launcher.starts) == 2 and rt.engines() == []
        await rt.close()

    run(main)


def test_a_replacement_loads_the_weights_of_the_last_update_before_it_serves() -> None:
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock)

    async def main() -> list[int]:
        rt = Runtime(Slime(1, 1), launcher=launcher, gpus=1, clock=clock)
        await rt.start()
        await rt.update_weights("/weights/step-3", 3)
        launcher.started[0].kill()
        out = await rt.turns("t0", "g").generate([1], 5, Sampling(), [])
        await rt.close()
        return out.policy_versions

    assert run(main) == [3] * 5
    assert launcher.started[1].weights == ("/weights/step-3", 3)


def test_the_default_policy_loses_no_trajectory_when_its_only_engine_is_killed() -> None:
    """The `treadle` policy's pool on 4 GPUs is one TP-4 engine; killed mid-batch, it
    is relaunched and every trajectory of the batch completes."""
    cost = CostModel.named("qwen3-14b", "h100")
    workload = generate("math", 256, seed=3, group_size=4, max_context=cost.model.max_context)
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock, startup_s=2.0)

    async def main() -> list[Any]:
        scheduler = build_policy(parse_policy("treadle"), cost, batch_size=256)
        rt = Runtime(scheduler, launcher=launcher, gpus=4, clock=clock)
        await rt.start()
        assert [s.tp for s in rt.engines()] == [4]
        jobs = [asyncio.ensure_future(replay_timed(t, rt)) for t in workload.trajectories]
        await clock.sleep(10.0)
        assert 0 < sum(j.done() for j in jobs) < len(jobs)  # mid-batch
        launcher.started[0].kill()
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out

    out = run(main)
    assert [getattr(r, "output_tokens", r) for r in out] == \
        [t.output_tokens for t in workload.trajectories]
    assert len(launcher.started) == 2


def test_a_stopped_busy_engine_fails_its_health_checks_and_its_turns_move() -> None:
    """A SIGSTOPped engine holds its calls until their timeout (600 s here); its
    health checks, busy or not, take it out within two intervals instead."""
    clock = FakeClock(autojump=True)
    stuck, good = FakeEngine("stuck", clock), FakeEngine("good", clock)
    specs = [spec(f"t{i}", 400, 300) for i in range(16)]

    async def main() -> list[Any]:
        rt = Runtime(Slime(1, 1), clock=clock, request_timeout_s=600.0,
                     health_interval_s=5.0)
        rt.register_engine(stuck, label="stuck")
        rt.register_engine(good, label="good")
        await rt.start()
        jobs = [asyncio.ensure_future(replay_timed(s, rt)) for s in specs]
        await clock.sleep(0.05)
        assert stuck.requests, "the stuck engine got no call before it stopped"
        stuck.stop()
        out = await asyncio.gather(*jobs)
        assert [s.label for s in rt.engines()] == ["good"]
        assert clock.now() < 30.0  # two 5 s checks, then the rest on the good engine
        await rt.close()
        return out

    out = run(main)
    assert [getattr(r, "output_tokens", r) for r in out] == [700] * 16


def test_an_engine_not_serving_the_model_leaves_the_pool_at_its_first_404() -> None:
    clock = FakeClock(autojump=True)
    wrong, good = FakeEngine("wrong", clock), FakeEngine("good", clock)
    wrong.model_missing = True

    async def main() -> list[Any]:
        rt = Runtime(Slime(1, 1), clock=clock)
        rt.register_engine(wrong, label="wrong")
        rt.register_engine(good, label="good")
        await rt.start()
        out = await asyncio.gather(*(replay_timed(spec(f"t{i}", 40, 30), rt)
                                     for i in range(8)))
        assert [s.label for s in rt.engines()] == ["good"]
        assert any("does not exist" in why for _, why in rt.failures)
        await rt.close()
        return out

    out = run(main)
    assert [getattr(r, "output_tokens", r) for r in out] == [70] * 8

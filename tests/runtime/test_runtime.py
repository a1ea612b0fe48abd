"""The live runtime with in-process fake engines: admission, preemption, failures,
retries, pauses and drains, as the scheduler's decisions are carried out."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from runtime_helpers import FakeEngine, FakeManualScheduler

from treadle.agent.loop import Sampling
from treadle.core.cost_model import CostModel
from treadle.core.policies.baselines import Slime
from treadle.core.scheduler import Scheduler
from treadle.engines.base import derived_seed
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_client import EmulatedEngineClient
from treadle.engines.emulated_server import serve_in_thread
from treadle.engines.errors import EngineUnavailable, NoEngineAvailable
from treadle.runtime.driver import Runtime
from treadle.runtime.launcher import EngineLauncher, LaunchedEngine
from treadle.runtime.replay import replay
from treadle.runtime.turns import ScheduledTurns
from treadle.workloads import TrajectorySpec, TurnSpec
from vllm_server import RecordingEngine

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), timeout_s)

    return asyncio.run(bounded())


def spec(tid: str, *turns: int, latency: float = 0.01) -> TrajectorySpec:
    shapes = [TurnSpec(n, latency, 5) for n in turns[:-1]] + [TurnSpec(turns[-1], 0.0, 0)]
    return TrajectorySpec(tid, f"g-{tid}", 16, tuple(shapes))


async def with_engines(scheduler: Scheduler, engines: list[FakeEngine],
                       **kw: Any) -> Runtime:
    rt = Runtime(scheduler, **kw)
    for e in engines:
        rt.register_engine(e, label=e.name)
    await rt.start()
    return rt


def test_trajectories_run_on_admitted_engines_and_leave_no_state() -> None:
    engines = [FakeEngine("a"), FakeEngine("b")]
    sched = Slime(1, 1)

    async def main() -> list[Any]:
        rt = await with_engines(sched, engines)
        specs = [spec(f"t{i}", 20, 30) for i in range(6)]
        out = await asyncio.gather(*(replay(s, rt.turns(s.traj_id, s.group_id), rt.clock)
                                     for s in specs))
        await rt.close()
        assert rt.control.decisions > 0 and rt.control.events >= 6 * 5
        assert rt.control.max_live == 6 and rt.live_trajectories == 0
        return out

    results = run(main)
    assert [r.output_tokens for r in results] == [50] * 6
    assert all(e.requests for e in engines)  # least-loaded spread them
    assert sched.trajs == {}  # forgotten once done: a long-lived runtime stays bounded
    # Each turn's context is the whole trajectory so far (prompt + outputs + observations).
    second = [r for e in engines for r in e.requests if r.request_id.endswith(":1:2")]
    assert second and all(len(r.prompt_ids) == 16 + 20 + 5 for r in second)
    assert all(e.closed for e in engines)


def test_a_preempted_turn_resumes_with_the_tokens_it_had() -> None:
    engine = FakeEngine("a", tokens_per_s=1000)
    sched = FakeManualScheduler(cap=1)

    async def main() -> Any:
        rt = await with_engines(sched, [engine])
        turns = rt.turns("t0", "g0")
        task = asyncio.ensure_future(turns.generate([1, 2, 3], 300, Sampling(), []))
        await asyncio.sleep(0.08)
        sched.to_preempt.append("t0")
        rt._decide()
        out = await task
        await rt.close()
        return out, turns

    out, turns = run(main)
    first, second = engine.requests
    assert first.max_tokens == 300 and first.prompt_ids == [1, 2, 3]
    kept = len(second.prompt_ids) - 3
    assert 0 < kept < 300 and second.max_tokens == 300 - kept
    assert second.prompt_ids[3:] == out.output_ids[:kept]
    assert len(out.output_ids) == 300 and out.finish_reason == "length"
    assert turns.preemptions == 1 and sched.preemptions == 1


def test_a_preempted_turn_on_the_emulated_engine_resumes_with_its_tokens() -> None:
    """The same preemption over HTTP against the real emulated engine and its client:
    the abort endpoint hands back the partial reply, and the resumed call extends it."""
    model = EmulatedEngine(CostModel.named("qwen3-14b", "h100"), time_scale=0.2, seed=3)
    sched = FakeManualScheduler(cap=1)

    async def main(url: str, name: str) -> Any:
        engine = RecordingEngine(EmulatedEngineClient(url, name))
        rt = Runtime(sched)
        rt.register_engine(engine, label="emulated")
        await rt.start()
        turns = rt.turns("t0", "g0")
        task = asyncio.ensure_future(turns.generate([1, 2, 3], 300, Sampling(seed=9), []))
        await asyncio.sleep(0.3)  # some of its ~1.5 s of tokens are out
        sched.to_preempt.append("t0")
        rt._decide()
        out = await task
        await rt.close()
        return out, turns, engine

    with serve_in_thread(model, "qwen3-14b-emulated") as running:
        out, turns, engine = run(lambda: main(running.url, running.model))
    (first, partial), (second, rest) = engine.calls
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 300
    assert first.max_tokens == 300 and first.prompt_ids == [1, 2, 3]
    assert second.prompt_ids == [1, 2, 3, *partial.output_ids]
    assert second.max_tokens == 300 - len(partial.output_ids)
    # The resumed call has a seed of its own: the turn's again would replay its draws.
    assert (first.seed, second.seed) == (9, derived_seed(9, len(partial.output_ids)))
    assert out.output_ids == partial.output_ids + rest.output_ids and len(out.output_ids) == 300
    assert out.logprobs == partial.logprobs + rest.logprobs
    assert turns.preemptions == 1


def test_a_dead_engine_sends_its_turns_to_the_survivor() -> None:
    a, b = FakeEngine("a", tokens_per_s=500), FakeEngine("b", tokens_per_s=500)
    sched = Slime(1, 1)

    async def main() -> tuple[list[Any], Runtime]:
        rt = await with_engines(sched, [a, b])
        specs = [spec(f"t{i}", 100) for i in range(6)]
        jobs = [asyncio.ensure_future(replay(s, rt.turns(s.traj_id, s.group_id), rt.clock))
                for s in specs]
        await asyncio.sleep(0.05)
        a.kill()
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out, rt

    results, rt = run(main)
    assert [r.output_tokens for r in results] == [100] * 6
    assert [s.label for s in rt.engines()] == ["b"]
    redone = {r.request_id.split(":")[0] for r in b.requests if not r.request_id.endswith(":1")}
    assert redone and all(len(r.prompt_ids) == 16 for r in b.requests)  # full re-prefill


def test_when_the_last_engine_dies_every_trajectory_ends_with_the_reason() -> None:
    a = FakeEngine("a", tokens_per_s=200)
    sched = FakeManualScheduler(cap=1)

    async def main() -> list[Any]:
        rt = await with_engines(sched, [a])
        jobs = [asyncio.ensure_future(replay(spec(f"t{i}", 100), rt.turns(f"t{i}", "g"),
                                             rt.clock)) for i in range(3)]
        await asyncio.sleep(0.05)
        a.kill()
        out = await asyncio.gather(*jobs, return_exceptions=True)
        await rt.close()
        return out

    errors = run(main)
    assert all(isinstance(e, NoEngineAvailable) for e in errors), errors
    assert "no engine left" in str(errors[0]) and "failed: a" in str(errors[0])


def test_a_turn_with_no_engine_at_all_gives_up_after_engine_wait_s() -> None:
    async def main() -> None:
        rt = Runtime(Slime(1, 1), engine_wait_s=0.1)
        await rt.start()
        with pytest.raises(NoEngineAvailable):
            await rt.turns("t0", "g").generate([1], 5, Sampling(), [])
        await rt.close()

    run(main)


def test_an_engine_registered_later_picks_up_waiting_turns() -> None:
    engine = FakeEngine("late")

    async def main() -> Any:
        rt = Runtime(Slime(1, 1), engine_wait_s=5.0)
        await rt.start()
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], 5, Sampling(), []))
        await asyncio.sleep(0.05)
        rt.register_engine(engine)
        out = await task
        await rt.close()
        return out

    assert len(run(main).output_ids) == 5


class SlowLauncherDouble(EngineLauncher):
    """Starts a `FakeEngine` after a delay, as a real process would take to come up."""

    async def start(self, tp: int) -> LaunchedEngine:
        await asyncio.sleep(0.2)

        async def stop() -> None:
            return None

        return LaunchedEngine(FakeEngine("late"), tp, 16, 1 << 20, "fake://late", "late", stop)

    def startup_s(self, tp: int) -> float:
        return 0.2


def test_turns_waiting_on_a_launch_run_on_the_engine_it_starts() -> None:
    async def main() -> int:
        rt = Runtime(Slime(1, 1), launcher=SlowLauncherDouble(), gpus=1, engine_wait_s=5.0)
        turns = rt.turns("t0", "g")
        first = asyncio.ensure_future(turns.generate([1], 5, Sampling(), []))
        await asyncio.sleep(0.01)
        await rt._launch(1)  # the pool was empty while it started
        out = await first
        turns.turn_finished(5, 6, final=False)
        turns.tool_started()
        turns.tool_finished(0.0, 1, final=False)
        second = await turns.generate([1] * 7, 5, Sampling(), [])  # still has its engine
        await rt.close()
        return len(out.output_ids) + len(second.output_ids)

    assert run(main) == 10


def test_a_flaky_but_live_engine_is_retried_then_given_up_on() -> None:
    engine = FakeEngine("a")

    async def main() -> tuple[Any, ScheduledTurns]:
        rt = await with_engines(Slime(1, 1), [engine], turn_retries=3)
        engine.flaky = 2
        turns = rt.turns("t0", "g")
        out = await turns.generate([1], 5, Sampling(), [])
        engine.flaky = 10
        with pytest.raises(EngineUnavailable, match="failed 4 times"):
            await rt.turns("t1", "g").generate([1], 5, Sampling(), [])
        await rt.close()
        return out, turns

    out, turns = run(main)
    assert len(out.output_ids) == 5 and turns.retries == 2


def test_pause_abort_resumes_turns_under_the_new_policy_version() -> None:
    engine = FakeEngine("a", tokens_per_s=1000)

    async def main() -> Any:
        rt = await with_engines(Slime(1, 1), [engine])
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], 300, Sampling(), []))
        await asyncio.sleep(0.08)
        await rt.pause("abort")
        assert not task.done()  # held at the gate, tokens kept
        rt.resume(policy_version=7)
        out = await task
        await rt.close()
        return out

    out = run(main)
    versions = out.policy_versions
    assert len(versions) == 300 and versions[0] == 0 and versions[-1] == 7
    assert versions == sorted(versions)  # old version first, then the new one


def test_pause_wait_lets_calls_in_flight_finish_first() -> None:
    engine = FakeEngine("a", tokens_per_s=1000)

    async def main() -> None:
        rt = await with_engines(Slime(1, 1), [engine])
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], 50, Sampling(), []))
        await asyncio.sleep(0.01)
        await rt.pause("wait")
        assert task.done() and task.result().policy_versions == [0] * 50
        later = asyncio.ensure_future(rt.turns("t1", "g").generate([1], 5, Sampling(), []))
        await asyncio.sleep(0.05)
        assert not later.done() and len(engine.requests) == 1
        rt.resume(policy_version=1)
        assert (await later).policy_versions == [1] * 5
        await rt.close()

    run(main)


def test_a_drained_engine_is_removed_once_its_calls_finish() -> None:
    a, b = FakeEngine("a", tokens_per_s=500), FakeEngine("b", tokens_per_s=500)

    async def main() -> Runtime:
        rt = await with_engines(Slime(1, 1), [a, b])
        jobs = [asyncio.ensure_future(rt.turns(f"t{i}", "g").generate([1], 50, Sampling(), []))
                for i in range(4)]
        await asyncio.sleep(0.02)
        rt.drain_engine("e000")
        await asyncio.gather(*jobs)
        await asyncio.sleep(0)
        assert [s.engine_id for s in rt.engines()] == ["e001"]
        await rt.turns("t9", "g").generate([1], 5, Sampling(), [])
        await rt.close()
        return rt

    run(main)
    assert a.closed and len(b.requests) >= 3

"""The live runtime with in-process fake engines on a fake clock: admission,
preemption, failures, retries, pauses and drains, as the scheduler's decisions are
carried out. Every wait is on the fake clock, so times are exact."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from runtime_helpers import FakeEngine, FakeLauncher, FakeManualScheduler, until

from treadle.agent.runner import Sampling
from treadle.core.cost_model import CostModel
from treadle.core.policies.baselines import Slime
from treadle.core.scheduler import Scheduler
from treadle.engines.base import derived_seed
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_client import EmulatedEngineClient
from treadle.engines.emulated_server import serve_in_thread
from treadle.engines.errors import EngineUnavailable, NoEngineAvailable
from treadle.runtime.driver import Runtime
from treadle.runtime.replay import ReplayResult, replay
from treadle.runtime.turns import ScheduledTurns
from treadle.testing import FakeClock
from treadle.types import JsonObjectConstraint
from treadle.workloads import TrajectorySpec, TurnSpec
from vllm_server import RecordingEngine

T = TypeVar("T")


def run(main: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), timeout_s)  # a hang fails; it is no timing

    return asyncio.run(bounded())


def spec(tid: str, *turns: int, latency: float = 0.01) -> TrajectorySpec:
    shapes = [TurnSpec(n, latency, 5) for n in turns[:-1]] + [TurnSpec(turns[-1], 0.0, 0)]
    return TrajectorySpec(tid, f"g-{tid}", 16, tuple(shapes))


async def with_engines(scheduler: Scheduler, engines: list[FakeEngine],
                       **kw: Any) -> Runtime:
    rt = Runtime(scheduler, clock=engines[0].clock, **kw)
    for e in engines:
        rt.register_engine(e, label=e.name)
    await rt.start()
    return rt


async def replay_timed(s: TrajectorySpec, rt: Runtime) -> ReplayResult | tuple[float, Exception]:
    """The replay's result, or (clock time, error) when it raised."""
    try:
        return await replay(s, rt.turns(s.traj_id, s.group_id), rt.clock)
    except Exception as e:
        return rt.clock.now(), e


def test_trajectories_run_on_admitted_engines_and_leave_no_state() -> None:
    clock = FakeClock(autojump=True)
    engines = [FakeEngine("a", clock), FakeEngine("b", clock)]
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
    # 20 tokens at 2000/s, a 10 ms tool, 30 tokens: every one, on either engine.
    assert [r.finished_at for r in results] == pytest.approx([0.035] * 6)
    assert all(e.requests for e in engines)  # least-loaded spread them
    assert sched.trajs == {}  # forgotten once done: a long-lived runtime stays bounded
    # Each turn's context is the whole trajectory so far (prompt + outputs + observations).
    second = [r for e in engines for r in e.requests if r.request_id.endswith(":1:2")]
    assert second and all(len(r.prompt_ids) == 16 + 20 + 5 for r in second)
    assert all(e.closed for e in engines)


def test_a_preempted_turn_resumes_with_the_tokens_it_had() -> None:
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock, tokens_per_s=1000)
    sched = FakeManualScheduler(cap=1)

    async def main() -> Any:
        rt = await with_engines(sched, [engine])
        turns = rt.turns("t0", "g0")
        task = asyncio.ensure_future(turns.generate([1, 2, 3], 300, Sampling(), []))
        await clock.sleep(0.08)  # 80 of its tokens are out
        sched.to_preempt.append("t0")
        rt.decide()
        out = await task
        await rt.close()
        return out, turns

    out, turns = run(main)
    first, second = engine.requests
    assert first.max_tokens == 300 and first.prompt_ids == [1, 2, 3]
    assert second.prompt_ids == [1, 2, 3, *out.output_ids[:80]] and second.max_tokens == 220
    assert len(out.output_ids) == 300 and out.finish_reason == "length"
    assert out.generating_s == pytest.approx(0.3)  # no token was sampled twice
    assert turns.preemptions == 1 and sched.preemptions == 1


def test_a_preempted_constrained_turn_starts_over() -> None:
    """A reply decoded under a constraint cannot resume mid-way (the engine's grammar
    would begin anew after the partial output): preempted, it samples again from its
    start, and its partial tokens are in no reply."""
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock, tokens_per_s=1000)
    sched = FakeManualScheduler(cap=1)
    constrained = Sampling(constraint=JsonObjectConstraint())

    async def main() -> Any:
        rt = await with_engines(sched, [engine])
        task = asyncio.ensure_future(rt.turns("t0", "g0").generate([1, 2, 3], 300,
                                                                   constrained, []))
        await clock.sleep(0.08)  # 80 of its tokens are out
        sched.to_preempt.append("t0")
        rt.decide()
        out = await task
        await rt.close()
        return out

    out = run(main)
    first, second = engine.requests
    assert first.constraint == second.constraint == JsonObjectConstraint()
    assert second.prompt_ids == [1, 2, 3] and second.max_tokens == 300
    assert len(out.output_ids) == 300 == len(out.logprobs) == len(out.policy_versions)


def test_a_preempted_turn_on_the_emulated_engine_resumes_with_its_tokens() -> None:
    """The same preemption over HTTP against the real emulated engine (in a thread, on
    real time) and its client: the abort endpoint hands back the partial reply, and
    the resumed call extends it. The engine samples slowly (50 ms a token) until its
    first call is back, so that the abort lands long before that call could end."""
    model = EmulatedEngine(CostModel.named("qwen3-14b", "h100"), time_scale=2.0, seed=3)
    sched = FakeManualScheduler(cap=1)

    async def main(url: str, name: str) -> Any:
        engine = RecordingEngine(EmulatedEngineClient(url, name))
        rt = Runtime(sched)
        rt.register_engine(engine, label="emulated")
        await rt.start()
        turns = rt.turns("t0", "g0")
        task = asyncio.ensure_future(turns.generate([1, 2, 3], 300, Sampling(seed=9), []))
        while model.steps < 1:  # its first token is out (the engine runs in a thread)
            await asyncio.sleep(0.005)
        sched.to_preempt.append("t0")
        rt.decide()
        while not engine.calls:  # the aborted call is back
            await asyncio.sleep(0.005)
        model.time_scale = 0.05  # the rest at 1.25 ms a token
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
    clock = FakeClock(autojump=True)
    a, b = FakeEngine("a", clock, tokens_per_s=500), FakeEngine("b", clock, tokens_per_s=500)
    sched = Slime(1, 1)

    async def main() -> tuple[list[Any], Runtime]:
        rt = await with_engines(sched, [a, b])
        specs = [spec(f"t{i}", 100) for i in range(6)]
        jobs = [asyncio.ensure_future(replay(s, rt.turns(s.traj_id, s.group_id), rt.clock))
                for s in specs]
        await clock.sleep(0.05)
        a.kill()
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out, rt

    results, rt = run(main)
    assert [r.output_tokens for r in results] == [100] * 6
    assert [s.label for s in rt.engines()] == ["b"] and len(rt.failures) == 1
    redone = {r.request_id.split(":")[0] for r in b.requests if not r.request_id.endswith(":1")}
    assert redone == {"t0", "t2", "t4"}  # a's, least-loaded: every other one
    assert all(len(r.prompt_ids) == 16 for r in b.requests)  # full re-prefill
    # b's own end at 0.2 s; a's start again at the kill and end 0.2 s later.
    assert [r.finished_at for r in results] == pytest.approx([0.25, 0.2] * 3)


def test_when_the_last_engine_dies_waiting_turns_fail_exactly_after_the_grace() -> None:
    clock = FakeClock(autojump=True)
    a = FakeEngine("a", clock, tokens_per_s=200)
    sched = FakeManualScheduler(cap=1)

    async def main() -> list[Any]:
        rt = await with_engines(sched, [a], engine_wait_s=60.0)
        jobs = [asyncio.ensure_future(replay_timed(spec(f"t{i}", 100), rt)) for i in range(3)]
        await clock.sleep(0.05)
        a.kill()
        out = await asyncio.gather(*jobs)
        await rt.close()
        return out

    out = run(main)
    # One was running, two queued since 0: each waits 60 s from the kill, no less.
    assert [when for when, _ in out] == pytest.approx([60.05] * 3)
    errors = [error for _, error in out]
    assert all(isinstance(e, NoEngineAvailable) for e in errors), errors
    assert "no engine left" in str(errors[0]) and "failed: a" in str(errors[0])


def test_a_turn_with_no_engine_at_all_gives_up_a_grace_after_it_began_waiting() -> None:
    clock = FakeClock(autojump=True)

    async def main() -> float:
        rt = Runtime(Slime(1, 1), clock=clock, engine_wait_s=10.0)
        await rt.start()
        await clock.sleep(25.0)  # no engine since 0; the turn's grace starts with its wait
        with pytest.raises(NoEngineAvailable):
            await rt.turns("t0", "g").generate([1], 5, Sampling(), [])
        await rt.close()
        return clock.now()

    assert run(main) == pytest.approx(35.0)


def test_an_engine_registered_within_the_grace_picks_up_waiting_turns() -> None:
    clock = FakeClock(autojump=True)
    engine = FakeEngine("late", clock)

    async def main() -> Any:
        rt = Runtime(Slime(1, 1), clock=clock, engine_wait_s=5.0)
        await rt.start()
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], 5, Sampling(), []))
        await clock.sleep(4.99)
        rt.register_engine(engine)
        out = await task
        await rt.close()
        return out

    out = run(main)
    assert len(out.output_ids) == 5 and out.queued_s == pytest.approx(4.99)
    assert clock.now() >= 4.99 + 5 / 2000


@pytest.mark.parametrize("grace", [5.0, 0.1])
def test_turns_waiting_on_a_launch_run_on_the_engine_it_starts(grace: float) -> None:
    """Also when the launch outlasts the grace: a start under way at its end decides."""
    clock = FakeClock(autojump=True)

    async def main() -> int:
        launcher = FakeLauncher(clock, startup_s=0.2)
        rt = Runtime(Slime(1, 1), launcher=launcher, gpus=1, clock=clock, engine_wait_s=grace)
        turns = rt.turns("t0", "g")
        first = asyncio.ensure_future(turns.generate([1], 5, Sampling(), []))
        await until(lambda: turns.waiting_since is not None)
        await rt.pool.launch(1)  # the pool was empty while it started
        out = await first
        turns.turn_finished(5, 6, final=False)
        turns.tool_started()
        turns.tool_finished(0.0, 1, final=False)
        second = await turns.generate([1] * 7, 5, Sampling(), [])  # still has its engine
        await rt.close()
        return len(out.output_ids) + len(second.output_ids)

    assert run(main) == 10


def test_a_flaky_but_live_engine_is_retried_then_given_up_on() -> None:
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock)

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
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock, tokens_per_s=1000)

    async def main() -> Any:
        rt = await with_engines(Slime(1, 1), [engine])
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], 300, Sampling(), []))
        await clock.sleep(0.08)
        await rt.pause("abort")
        assert not task.done()  # held at the gate, tokens kept
        await clock.sleep(1.0)  # however long the weights take to load
        rt.resume(policy_version=7)
        out = await task
        await rt.close()
        return out

    out = run(main)
    assert out.policy_versions == [0] * 80 + [7] * 220  # old version first, then the new


def test_pause_wait_lets_calls_in_flight_finish_first() -> None:
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock, tokens_per_s=1000)

    async def main() -> None:
        rt = await with_engines(Slime(1, 1), [engine])
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], 50, Sampling(), []))
        await clock.sleep(0.01)
        await rt.pause("wait")
        assert clock.now() == pytest.approx(0.05)  # when the call in flight ended
        assert task.done() and task.result().policy_versions == [0] * 50
        later = asyncio.ensure_future(rt.turns("t1", "g").generate([1], 5, Sampling(), []))
        await clock.sleep(10.0)
        assert not later.done() and len(engine.requests) == 1
        rt.resume(policy_version=1)
        assert (await later).policy_versions == [1] * 5
        await rt.close()

    run(main)


def test_a_drained_engine_is_removed_once_its_calls_finish() -> None:
    clock = FakeClock(autojump=True)
    a, b = FakeEngine("a", clock, tokens_per_s=500), FakeEngine("b", clock, tokens_per_s=500)

    async def main() -> Runtime:
        rt = await with_engines(Slime(1, 1), [a, b])
        jobs = [asyncio.ensure_future(rt.turns(f"t{i}", "g").generate([1], 50, Sampling(), []))
                for i in range(4)]
        await clock.sleep(0.02)
        rt.drain_engine("e000")
        await asyncio.gather(*jobs)
        assert [s.engine_id for s in rt.engines()] == ["e001"]
        await rt.turns("t9", "g").generate([1], 5, Sampling(), [])
        await rt.close()
        return rt

    run(main)
    assert a.closed and len(b.requests) == 3  # its two, and the one after the drain

"""Weight updates in each mode ("abort", "drain", "keep"), and bounded by a timeout.

On the emulated engine over HTTP (it can keep calls: `pause_modes` has "keep") and
on `FakeEngine` (it declares no pause mode: a "keep" update aborts its calls and
resumes them), with a `FakeClock` where the timing is the point.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from runtime_helpers import FakeEngine
from test_runtime import run, with_engines

from treadle.agent.runner import Sampling, TurnOutput
from treadle.core.cost_model import CostModel
from treadle.core.events import Event, PolicyUpdated
from treadle.core.policies.baselines import Slime
from treadle.core.scheduler import TrajState
from treadle.engines.base import PauseMode
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_client import EmulatedEngineClient
from treadle.engines.emulated_server import serve_in_thread
from treadle.engines.errors import WeightUpdateTimeout
from treadle.runtime.driver import Runtime, WeightUpdate
from treadle.testing import FakeClock
from treadle.types import KVAcrossUpdates
from vllm_server import RecordingEngine

COST = CostModel.named("qwen3-14b", "h100")


async def _first_tokens_out(model: EmulatedEngine, steps: int) -> None:
    while model.steps < steps:  # the engine runs in a thread: polled, not timed
        await asyncio.sleep(0.005)


def _keep_on_emulated(mode: str, kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
                      ) -> tuple[Any, Any, RecordingEngine, EmulatedEngine]:
    model = EmulatedEngine(COST, time_scale=0.5, seed=3, load_s=0.2)

    async def main(url: str, name: str) -> tuple[Any, Any, RecordingEngine]:
        engine = RecordingEngine(EmulatedEngineClient(url, name))
        rt = Runtime(Slime(1, 1))
        rt.register_engine(engine, label="emulated")
        await rt.start()
        try:
            task = asyncio.ensure_future(
                rt.turns("t0", "g0", kv).generate([1, 2, 3], 300, Sampling(seed=1), []))
            await _first_tokens_out(model, 5)
            update = await rt.update_weights("/w/7", 7, mode, timeout_s=30.0)  # type: ignore[arg-type]
            assert not task.done()
            return update, await task, engine
        finally:
            await rt.close()

    with serve_in_thread(model, "qwen3-14b-emulated") as running:
        update, out, engine = run(lambda: main(running.url, running.model))
    return update, out, engine, model


def test_keep_continues_the_call_in_flight_under_the_new_weights() -> None:
    update, out, engine, model = _keep_on_emulated("keep")
    assert (update.kept, update.aborted) == (1, 0)
    assert len(engine.calls) == 1  # one call: frozen in the engine, never re-sent
    (_, result), = engine.calls
    assert result.finish_reason == "length" and len(out.output_ids) == 300
    old = out.policy_versions.count(0)
    assert 5 <= old < 300 and out.policy_versions == [0] * old + [7] * (300 - old)
    assert [(s.version, s.end - s.start) for s in result.version_spans] == [
        (None, old), ("7", 300 - old)]
    assert model.weight_version == "7"
    # Its trajectory recomputes KV under new weights: the engine is told so.
    assert engine.updates == [("keep", True)]


def test_a_kept_call_of_a_trajectory_that_keeps_its_kv_is_not_recomputed() -> None:
    update, _, engine, _ = _keep_on_emulated("keep", KVAcrossUpdates.KEEP)
    assert update.kept == 1 and engine.updates == [("keep", False)]


def test_abort_resumes_the_call_with_its_tokens_under_the_new_weights() -> None:
    update, out, engine, _ = _keep_on_emulated("abort")
    assert (update.kept, update.aborted) == (0, 1)
    (first, partial), (second, _) = engine.calls
    assert partial.finish_reason == "abort" and 5 <= len(partial.output_ids) < 300
    assert second.prompt_ids == [1, 2, 3, *partial.output_ids]  # nothing discarded
    old = len(partial.output_ids)
    assert out.policy_versions == [0] * old + [7] * (300 - old)
    assert first.cache_salt is not None and first.cache_salt.startswith("policy-0-")
    assert second.cache_salt is not None and second.cache_salt.startswith("policy-7-")


def _update_during_a_call(engine: FakeEngine, tokens: int, after_s: float,
                          mode: PauseMode) -> tuple[WeightUpdate, TurnOutput, float]:
    """One call of `tokens` on `engine` (a fake clock's), an update to version 3 in
    `mode` `after_s` into it: the update, the turn and the clock when the update
    returned."""
    clock = engine.clock

    async def main() -> tuple[WeightUpdate, TurnOutput, float]:
        rt = await with_engines(Slime(1, 1), [engine])
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], tokens, Sampling(), []))
        await clock.sleep(after_s)
        update = await rt.update_weights("/w/3", 3, mode)
        returned = clock.now()
        out = await task
        await rt.close()
        return update, out, returned

    return run(main)


def test_drain_lets_the_call_finish_under_the_old_weights_first() -> None:
    engine = FakeEngine("a", FakeClock(autojump=True), tokens_per_s=1000, load_s=2.0)
    update, out, returned = _update_during_a_call(engine, 50, 0.01, "drain")
    assert out.policy_versions == [0] * 50
    assert engine.loading_with_calls == 0 and engine.weights == ("/w/3", 3)
    # Held from the pause (0.01) to the end of the load: the call's 0.04 s left + 2 s.
    assert update.held_s == pytest.approx(2.04) and returned == pytest.approx(2.05)
    assert (update.kept, update.aborted) == (0, 0)


def test_keep_on_an_engine_that_cannot_keep_aborts_and_resumes_its_calls() -> None:
    engine = FakeEngine("a", FakeClock(autojump=True), tokens_per_s=1000, load_s=1.0)
    update, out, _ = _update_during_a_call(engine, 300, 0.08, "keep")
    assert (update.kept, update.aborted) == (0, 1)
    assert engine.loading_with_calls == 0  # nothing in flight while it loaded
    assert out.policy_versions == [0] * 80 + [3] * 220


def test_an_update_past_its_timeout_fails_and_leaves_the_old_weights_serving() -> None:
    clock = FakeClock(autojump=True)
    fast = FakeEngine("fast", clock, load_s=1.0)
    hung = FakeEngine("hung", clock, load_s=1.0)

    async def main() -> None:
        rt = await with_engines(Slime(1, 1), [fast, hung], relaunch=None)
        await rt.update_weights("/w/1", 1, "drain", timeout_s=10.0)
        before = rt.cache_salt
        hung.load_s = 3600.0  # its next load never ends in time
        started = clock.now()
        with pytest.raises(WeightUpdateTimeout, match="hung"):
            await rt.update_weights("/w/2", 2, "keep", timeout_s=10.0)
        # Bounded: the timeout, then the fast engine's reload of the old weights.
        assert clock.now() - started == pytest.approx(11.0)
        assert rt.policy_version == 1 and not rt.paused
        assert fast.weights == ("/w/1", 1)  # loaded v2, then v1 again
        assert [s.label for s in rt.engines()] == ["fast"]  # the hung one is failed
        out = await rt.turns("t", "g").generate([1], 5, Sampling(), [])
        assert out.policy_versions == [1] * 5
        # The old version's weights again, but a salt of their own.
        salt = fast.requests[-1].cache_salt
        assert salt is not None and salt.startswith("policy-1-") and salt != before
        await rt.close()

    run(main)


def test_a_drain_past_its_timeout_loads_nothing_and_lets_the_call_run_on() -> None:
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock, tokens_per_s=10)

    async def main() -> None:
        rt = await with_engines(Slime(1, 1), [engine])
        task = asyncio.ensure_future(rt.turns("t0", "g").generate([1], 100, Sampling(), []))
        await clock.sleep(1.0)
        with pytest.raises(WeightUpdateTimeout, match="calls in flight"):
            await rt.update_weights("/w/1", 1, "drain", timeout_s=2.0)
        assert engine.weights is None and rt.policy_version == 0 and not rt.paused
        assert (await task).policy_versions == [0] * 100
        await rt.close()

    run(main)


def test_kept_kv_salts_every_call_with_the_weights_of_its_first() -> None:
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock)

    async def main() -> None:
        rt = await with_engines(Slime(1, 1), [engine])
        keep = rt.turns("k", "g", KVAcrossUpdates.KEEP)
        fresh = rt.turns("r", "g")
        for turns in (keep, fresh):
            await turns.generate([1], 5, Sampling(), [])
            turns.turn_finished(5, 6, final=False)
            turns.tool_started()
        await rt.update_weights("/w/4", 4, "drain", trainer_run="run/a")
        for turns in (keep, fresh):
            turns.tool_finished(0.0, 1, final=False)
            await turns.generate([1], 5, Sampling(), [])
        await rt.close()

    run(main)
    salts = [r.cache_salt or "" for r in engine.requests]
    assert salts[0] == salts[1] == salts[2] and salts[0].startswith("policy-0-")
    assert salts[3].startswith("policy-4-") and "/" not in salts[3]


def test_the_scheduler_hears_each_new_version_and_runners_count_what_they_sampled() -> None:
    """A resume to a newer version is a `PolicyUpdated` for the scheduler (staleness
    weighs in its priorities); the same version again, or a new run's version 0, is
    not (versions only grow there). A running trajectory's runner counts the tokens
    its engines returned (what a restart of it discards)."""
    clock = FakeClock(autojump=True)
    engine = FakeEngine("a", clock, tokens_per_s=1000)
    heard: list[int] = []

    class Listening(Slime):
        def observe(self, event: Event, t: TrajState | None, now: float) -> None:
            if isinstance(event, PolicyUpdated):
                heard.append(event.version)
            super().observe(event, t, now)

    async def main() -> int:
        rt = await with_engines(Listening(1, 1), [engine])
        turns = rt.turns("t0", "g")
        await turns.generate([1], 30, Sampling(), [])
        sampled = rt.sampled_tokens("t0")
        for version in (3, 3, 4, 0, 5):
            rt.resume(policy_version=version)
        await rt.close()
        return sampled

    assert run(main) == 30
    assert heard == [3, 4, 5]

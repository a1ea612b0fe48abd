"""What the service and its runner actors send each other (`runtime.runner_wire`), without
Ray: every message survives `pack`/`unpack` (a `Told`'s event included) as it would a
pickle, and an engine's address makes a client of the same kind, URL, model and token."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from treadle.agent.journal import Resume, ResumeFrom
from treadle.agent.loop import AgentLimits
from treadle.agent.runner import Sampling, TurnOutput
from treadle.core.events import (
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnFinished,
    TurnPreempted,
)
from treadle.engines.emulated_client import EmulatedEngineClient
from treadle.engines.errors import NoEngineAvailable
from treadle.engines.sglang import SGLangEngine
from treadle.engines.vllm import VLLMEngine
from treadle.envs.registry import get_suite
from treadle.envs.worktree import WorkTree, WorkTreeCapture
from treadle.runtime.runner_wire import (
    AbortForPause,
    AdmitTurn,
    Answer,
    CallEnded,
    CallFailed,
    CallStarted,
    Cancel,
    CancelCall,
    Captured,
    Done,
    DropSuite,
    EngineAddress,
    EngineLost,
    Engines,
    FailTurn,
    Finished,
    Generate,
    Generated,
    Held,
    Hold,
    Journaled,
    KeepSuite,
    OpenTurns,
    PreemptTurn,
    Resumed,
    Sampled,
    StartReplay,
    StartTask,
    Told,
    ToolBegan,
    ToolDone,
    TurnDone,
    TurnsEnded,
    Weights,
    engine_address,
    engine_client,
    pack,
    unpack,
)
from treadle.types import (
    GroupKey,
    KVAcrossUpdates,
    ResumePoint,
    Task,
    Trajectory,
    TrajectoryStatus,
)
from treadle.workloads import TrajectorySpec, TurnSpec


def _messages() -> list[object]:
    address = EngineAddress("e1", "emulated", "http://10.0.0.2:20001", "m", tp=2)
    spec = TrajectorySpec("t", "g", 8, (TurnSpec(4, 0.0, 0),))
    return [
        Engines((address,), ("e0",)), Weights(3, "salt", open=False), Hold(7),
        StartReplay("t", "g", 1, spec, "task", 2, KVAcrossUpdates.KEEP,
                    Resume((), ()), 4, journaled=True),
        StartTask("t", "g", 1, "math#3", Task("q1", "what is 1 + 2?", "math", {"answer": "3"}),
                  Sampling(0.7, 0.9, 5), AgentLimits(3, 900), "qwen3", 1, KVAcrossUpdates.KEEP,
                  ResumeFrom(1, (b"\x81\xa1a\x01",), (), from_prompt=True), 2,
                  journaled=True),
        DropSuite("math#3"),
        OpenTurns("t", "g", KVAcrossUpdates.KEEP, 2),
        Generate("t", 3, [1, 2, 3], 64, Sampling(0.5, 1.0, 7), [9]), CancelCall("t", 3),
        TurnDone("t", 5, 40, False), ToolBegan("t"), ToolDone("t", 0.5, 7, True),
        TurnsEnded("t", "deadline"),
        Generated("t", 3, TurnOutput([4, 5], [-0.1, -0.2], [1, 1], "stop", "e1", 0.5, 1.5)),
        Generated("t", 5, None, failure="RuntimeError: trajectory t has ended"),
        Cancel("t"), AdmitTurn("t", "e1", -2.5), PreemptTurn("t", "e1"), EngineLost("t", "e1"),
        AbortForPause("t"), Answer(9, "retry"),
        Told("t", TrajectoryArrived("t", "g", 12, judge=True, max_staleness=2)),
        Told("t", TurnFinished("t", "e1", 5, 40, False)), Told("t", ToolCallStarted("t")),
        Told("t", ToolCallFinished("t", 0.5, 7, True)), Told("t", TurnPreempted("t", "e1", 3)),
        Told("t", TrajectoryEnded("t", "abandoned")),
        CallStarted("t", "e1"), CallEnded("t", "e1", 17), Sampled("t", 5),
        Journaled("t", 0, 5, b"\x81\xa1a\x01"), Resumed("t", ResumePoint(1, 2, 1, 0, 9, "")),
        Captured("t", WorkTree({"a.py": "x = 1\n"}, {"a.py": "x = 2\n"}, {"b": "binary"}),
                 None),
        Captured("t", None, "SandboxError: gone"), Done("t"), Held(7),
        Finished("t", Trajectory("t", GroupKey("g", 1), status=TrajectoryStatus.COMPLETED)),
        Finished("t", None, "cancelled in its runner"),
        Finished("t", None, "ValueError: a bug", raised=True),
    ]


def test_every_message_comes_back_equal_through_pack_and_a_pickle() -> None:
    batch = _messages()
    back = unpack(pickle.loads(pickle.dumps(pack(batch))))
    assert back == batch
    assert [type(m) for m in back] == [type(m) for m in batch]


def test_a_suite_and_a_capture_travel_with_what_they_hold() -> None:
    # Neither compares by value: what the actor uses of each must come through.
    suite = get_suite("math", python_tool=False)
    capture = WorkTreeCapture(max_files=7, max_file_bytes=99)
    keep, start = unpack(pickle.loads(pickle.dumps(pack([
        KeepSuite("math#1", suite),
        StartTask("t", "g", 0, "math#1", suite.tasks(1, seed=3)[0], Sampling(), AgentLimits(),
                  "hermes", capture=capture)]))))
    assert isinstance(keep, KeepSuite) and keep.key == "math#1"
    assert keep.suite.name == "math" and keep.suite.tasks(1, seed=3) == suite.tasks(1, seed=3)
    assert isinstance(start, StartTask) and start.capture is not None
    assert (start.capture.max_files, start.capture.max_file_bytes) == (7, 99)


def test_a_failed_turn_call_and_driven_turn_carry_their_engine_error() -> None:
    error = NoEngineAvailable("no engine is live")
    fail, failed, generated = unpack(pickle.loads(pickle.dumps(pack(
        [FailTurn("t", error), CallFailed(1, "t", "e1", error),
         Generated("t", 4, None, error)]))))
    assert isinstance(fail, FailTurn) and isinstance(fail.error, NoEngineAvailable)
    assert isinstance(failed, CallFailed) and str(failed.error) == "no engine is live"
    assert isinstance(generated, Generated) and isinstance(generated.error, NoEngineAvailable)
    assert str(generated.error) == "no engine is live"


@pytest.mark.parametrize(("engine", "kind"), [
    (EmulatedEngineClient("http://h:1", model="m-emulated", api_key="k"), "emulated"),
    (VLLMEngine("http://h:2", "served", api_key="k", tokens_api=True), "vllm"),
    (SGLangEngine("http://h:3", api_key="k"), "sglang"),
])
def test_an_engine_address_makes_a_client_of_the_same_engine(engine: object, kind: str) -> None:
    async def check() -> None:
        assert isinstance(engine, EmulatedEngineClient | VLLMEngine | SGLangEngine)
        address = engine_address("e3", engine, tp=4, max_batch=8, kv_capacity_tokens=64,
                                 label="x")
        assert address is not None and address.kind == kind and address.tp == 4
        again = engine_client(pickle.loads(pickle.dumps(address)))
        try:
            assert type(again) is type(engine)
            assert again.base_url == engine.base_url and again.headers == engine.headers
            if isinstance(engine, VLLMEngine):
                assert isinstance(again, VLLMEngine)
                assert (again.model, again.tokens_api) == (engine.model, engine.tokens_api)
        finally:
            await again.aclose()
            await engine.aclose()

    asyncio.run(check())


def test_a_resume_and_a_pause_in_one_batch_start_no_call() -> None:
    """`Weights(open)` then `Hold` in one push: a turn woken by the resume looks at the
    gate again before it calls, and finds it shut (its `Held` would otherwise be a lie:
    a call would start after it)."""
    from treadle.runtime.runner_actor import MirrorHost, _Link
    from treadle.testing import FakeClock

    async def main() -> None:
        # An autojumping fake clock's sleep returns once no task can run: the event
        # that every waiter the batch woke has run.
        clock = FakeClock(autojump=True)
        host = MirrorHost(clock, request_timeout_s=None, turn_retries=0)
        link = _Link(host, "t")  # the actor's RunnerHost for a trajectory
        waiting = asyncio.ensure_future(link.calls_allowed())
        await clock.sleep(1.0)  # it waits on the shut gate
        host.apply([Weights(1, "s1", open=True), Hold(7)])
        await clock.sleep(1.0)
        assert not waiting.done()
        host.apply([Weights(1, "s1", open=True)])
        await waiting

    asyncio.run(main())


def test_a_call_ended_carries_the_tokens_of_that_call() -> None:
    """`CallEnded.sampled` counts the call that just ended (the service's count of a
    remote trajectory's sampled tokens, what a restart discards, is never a call
    behind)."""
    from runtime.runtime_helpers import FakeEngine
    from treadle.agent.runner import Sampling
    from treadle.runtime.pool import EngineSlot
    from treadle.runtime.runner_actor import MirrorHost
    from treadle.runtime.runner_wire import CallEnded
    from treadle.testing import FakeClock

    async def main() -> list[int]:
        clock = FakeClock(autojump=True)
        host = MirrorHost(clock, request_timeout_s=None, turn_retries=0)
        host.engines["e1"] = EngineSlot("e1", FakeEngine("e1", tokens_per_s=1e9), 1, 8,
                                        4096, "e1")
        host.apply([Weights(0, "s0", open=True)])
        turns = host.turns("t", "g")
        generating = asyncio.ensure_future(
            turns.generate([1, 2, 3], 5, Sampling(temperature=1.0), []))
        await clock.sleep(1.0)  # no task can run: the turn waits for its admission
        assert any(isinstance(m, Told) for m in host.outbox)  # it has arrived
        turns.admit("e1", 0.0)
        await generating
        return [m.sampled for m in host.outbox if isinstance(m, CallEnded)]

    assert asyncio.run(main()) == [5]

"""A runner actor's host (`runtime.runner_actor.MirrorHost`) without Ray: the messages of
one batch are applied in order, a task keeps the suite it was started with, and the
host's copy of a fleet's backend follows the servers the fleet accepts."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.agent_helpers import build_tokenizer
from treadle.agent.loop import AgentLimits
from treadle.agent.runner import Sampling
from treadle.clock import ScaledClock
from treadle.core.events import TrajectoryArrived
from treadle.envs.base import Suite
from treadle.envs.registry import get_suite
from treadle.runtime.runner_actor import MirrorHost
from treadle.runtime.runner_wire import (
    DropSuite,
    Finished,
    KeepSuite,
    SandboxFleet,
    StartTask,
    Told,
)
from treadle.runtime.suite_pools import SuitePools
from treadle.sandbox.pool import PoolSettings
from treadle.sandbox.remote import RemoteBackend


def test_a_task_keeps_its_suite_when_the_same_batch_drops_it(tmp_path: Path) -> None:
    suite = get_suite("math", python_tool=False)
    [task] = suite.tasks(1, seed=4)

    async def go() -> tuple[list[object], list[str]]:
        host = MirrorHost(ScaledClock(1.0), request_timeout_s=None, turn_retries=0,
                          tokenizer=build_tokenizer(tmp_path / "tok"))
        host.apply([KeepSuite("math#1", suite),
                    StartTask("t", "g", 0, "math#1", task, Sampling(), AgentLimits(), "hermes"),
                    DropSuite("math#1")])
        # Its first turn waits for an admission (no engine here): it has arrived.
        while not any(isinstance(m, Told | Finished) for m in host.outbox):
            host.gathered.clear()  # as an exchange does: set again by the next message
            await host.gathered.wait()
        sent, kept = list(host.outbox), list(host.suites)
        await host.close()
        return sent, kept

    sent, kept = asyncio.run(go())
    assert isinstance(sent[0], Told) and isinstance(sent[0].event, TrajectoryArrived), sent
    assert kept == []  # the drop was applied


def test_a_runner_follows_the_sandbox_servers_its_fleet_accepts() -> None:
    backend = RemoteBackend(["http://a:1"], "token")  # the copy an actor was made with
    host = MirrorHost(ScaledClock(1.0), request_timeout_s=None, turn_retries=0,
                      sandboxes=SuitePools(backend, PoolSettings()))
    host.apply([SandboxFleet(("http://a:1", "http://b:1")), SandboxFleet(("http://b:1",))])
    assert backend.accepting() == ("http://b:1",)
    assert suite_pool_backend(host, get_suite("math")) is backend  # its pools use it


def suite_pool_backend(host: MirrorHost, suite: Suite) -> object:
    pool = host.sandboxes.pool(suite)
    assert pool is not None
    return pool.backend

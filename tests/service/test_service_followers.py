"""Followers of a job's results that hang up — once, or cancelled again and again as
anyio's cancel scopes do when a stream's client goes away — never hold back a
trajectory's completion, and the followers that stay get every result once."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service

from runtime.runtime_helpers import FakeEngine
from treadle.client import RolloutClient
from treadle.service.schemas import JobRequest
from treadle.service.state import ServiceConfig, build_service
from treadle.service.wakeups import JobWakeups


def _trace(n: int) -> list[dict[str, Any]]:
    return [{"id": f"t{i}", "group": f"g{i // 8}", "prompt_tokens": 8,
             "turns": [{"output_tokens": 4, "tool_latency_s": 0.2, "tool_output_tokens": 2},
                       {"output_tokens": 4, "tool_latency_s": 0.0, "tool_output_tokens": 0}]}
            for i in range(n)]


def _run_leaving_stuck_tasks(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """`asyncio.run`, except that tasks still pending when `main` ends are left, not
    awaited: a follower wedged in a lock cannot be cancelled, and waiting for it
    would hang the test instead of failing it."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


async def _cancel_until_done(task: asyncio.Task[Any]) -> None:
    """What a cancel scope does to a task inside it: cancel it at every loop turn."""
    while not task.done():
        task.cancel()
        await asyncio.sleep(0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_followers_that_hang_up_never_stall_delivery(seed: int) -> None:
    planned = 1024

    async def main() -> None:
        service = build_service(ServiceConfig(db=":memory:", policy="verl", max_live=64))
        await service.start()
        try:
            service.runtime.register_engine(FakeEngine("a", tokens_per_s=50_000))
            service.runtime.register_engine(FakeEngine("b", tokens_per_s=50_000))
            rollouts = service.rollouts
            info = await rollouts.submit(JobRequest.model_validate(
                {"tasks": {"trace": _trace(planned)}, "job_id": "j"}))

            async def follow() -> list[int]:
                return [d.seq async for d in rollouts.results(info.job_id, follow=True)
                        if d is not None]

            stayer = asyncio.create_task(follow())
            rng = random.Random(seed)
            # 100 followers at a time; one at random hangs up and another connects.
            followers = [asyncio.create_task(follow()) for _ in range(100)]
            hang_ups: set[asyncio.Task[None]] = set()

            async def churn() -> None:
                # Until the stayer has everything, or until nothing was delivered for
                # 30 s (a wedge; a merely slow machine still delivers).
                seen, since = -1, time.monotonic()
                checked = since
                while not stayer.done():
                    if time.monotonic() - checked > 1.0:  # a look now and then: the
                        checked = time.monotonic()  # churn itself must stay dense
                        delivered = (await rollouts.store.job(info.job_id)).delivered
                        if delivered != seen:
                            seen, since = delivered, checked
                        elif checked - since > 30:
                            return
                    for _ in range(rng.randrange(8)):
                        await asyncio.sleep(0)
                    i = rng.randrange(len(followers))
                    hang_up = asyncio.create_task(_cancel_until_done(followers[i]))
                    hang_ups.add(hang_up)
                    hang_up.add_done_callback(hang_ups.discard)
                    followers[i] = asyncio.create_task(follow())

            await churn()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stayer), 30)
            assert stayer.done(), f"delivery stalled at {rollouts.live} running"
            seqs = stayer.result()
            await asyncio.gather(*hang_ups, *(_cancel_until_done(f) for f in followers))
            assert seqs == list(range(1, planned + 1))
            view, running, queued = await rollouts.job(info.job_id)
            assert (view.status.value, view.delivered, running, queued) == \
                ("completed", planned, 0, 0)
            assert rollouts.live == 0 and service.runtime.live_trajectories == 0
            assert rollouts.followed_jobs == 0  # the followers that left hold nothing
        finally:
            await service.close()

    _run_leaving_stuck_tasks(main)


def test_a_wake_reaches_every_waiter_and_a_cancelled_waiter_leaves_it_to_the_others() -> None:
    async def main() -> None:
        wakeups = JobWakeups()
        shared = wakeups.future("j")
        assert wakeups.future("j") is shared and wakeups.future("j") is shared
        assert wakeups.jobs == 1
        waiters = [asyncio.create_task(asyncio.wait({shared})) for _ in range(3)]
        await asyncio.sleep(0)
        waiters[0].cancel()
        await asyncio.gather(waiters[0], return_exceptions=True)
        wakeups.leave("j", shared)  # the cancelled one leaves; the others still hold it
        assert not shared.cancelled() and wakeups.jobs == 1
        wakeups.wake("j")
        await asyncio.gather(*waiters[1:])
        assert shared.done() and wakeups.jobs == 0
        wakeups.leave("j", shared)  # leaving a woken future is harmless
        fresh = wakeups.future("j")
        assert fresh is not shared  # the next wake has a future of its own
        wakeups.leave("j", fresh)  # its only follower left: nothing is kept
        assert wakeups.jobs == 0
        wakeups.wake("other")  # a job nobody follows: nothing to do

    asyncio.run(main())


def test_an_idle_followed_stream_sends_blank_lines_and_the_client_skips_them(
        tmp_path: Path) -> None:
    # A job that waits for a policy version: its stream has nothing to say for ever.
    config = ServiceConfig(db=str(tmp_path / "t.db"), policy="verl", emulate=2, time_scale=0.02,
                           stream_heartbeat_s=0.05)
    with running_service(config) as url, httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/jobs", json={"tasks": {"trace": _trace(1)}, "job_id": "idle",
                                          "min_policy_version": 1})
        assert r.status_code == 201, r.text
        with client.stream("GET", "/v1/jobs/idle/trajectories",
                           params={"follow": "true"}) as stream:
            lines = stream.iter_lines()
            assert [next(lines), next(lines), next(lines)] == ["", "", ""]
        # The client reads through the heartbeats to what comes after them.
        client.post("/v1/weights/resume", json={"policy_version": 1})
        with RolloutClient(url) as rollout_client:
            assert [d.seq for d in rollout_client.trajectories("idle")] == [1]

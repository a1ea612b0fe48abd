"""The trainer's HTTP clients (sync and async) against a real service on loopback:
every route, resumption through dropped connections, groups as they complete,
infrastructure failures flagged."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.bench.faults import FaultyProxy
from treadle.client import (
    AsyncRolloutClient,
    Delivered,
    Group,
    RetryPolicy,
    RolloutClient,
    ServiceError,
    replay_tasks,
    suite_tasks,
)
from treadle.client.aio import AsyncRolloutClient as AsyncClientFromModule
from treadle.core.cost_model import CostModel
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_server import serve_in_thread
from treadle.runtime.replay import REPLAY_TOOL
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import TrajectoryStatus

pytestmark = [pytest.mark.integration]
TOKEN = "client-token"
FAST = RetryPolicy(attempts=30, backoff_s=0.05, max_backoff_s=0.5)


def _config(db: Path, **kw: Any) -> ServiceConfig:
    base: dict[str, Any] = dict(db=str(db), token=TOKEN, emulate=2, time_scale=0.02,
                                policy="verl")
    return ServiceConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = tmp_path_factory.mktemp("svc") / "t.db"
    with running_service(_config(db, time_scale=0.005)) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[RolloutClient]:
    with RolloutClient(url, token=TOKEN, retry=FAST) as c:
        yield c


def _wait_until(condition: Callable[[], bool]) -> None:
    """Until the service's state holds (looked at again and again; no deadline)."""
    while not condition():
        time.sleep(0.02)


def _max_seqs(groups: list[Group]) -> list[int]:
    return [max(d.seq for d in g.members) for g in groups]


def test_a_job_is_submitted_streamed_resumed_and_grouped(client: RolloutClient) -> None:
    job = client.submit(tasks=replay_tasks("math", trajectories=32, group_size=16),
                        job_id="j1", priority=5)
    assert (job.job_id, job.planned, job.group_size) == ("j1", 32, 16)
    got = list(client.trajectories("j1"))
    assert [d.seq for d in got] == list(range(1, 33))
    assert len({d.trajectory.trajectory_id for d in got}) == 32
    t = got[0].trajectory
    assert t.status is TrajectoryStatus.COMPLETED and t.output_tokens > 0
    # A replay's record says where its time went, turn by turn.
    assert all(turn.engine_id and turn.generating_s > 0 for turn in t.turns)
    assert [turn.tool_call is not None for turn in t.turns] == [True] * (len(t.turns) - 1) + [
        False]
    assert all(turn.tool_call.name == REPLAY_TOOL for turn in t.turns[:-1]
               if turn.tool_call is not None)
    assert t.timings.llm_s == pytest.approx(sum(turn.generating_s for turn in t.turns))
    state = client.job("j1")
    assert state.terminal and state.status == "completed" and state.delivered == 32
    assert state.counts["completed"] == 32 and state.progress == 1.0
    assert [d.seq for d in client.trajectories("j1", after=30)] == [31, 32]
    assert [d.seq for d in client.trajectories("j1", follow=False)] == list(range(1, 33))
    groups = list(client.groups(job))
    assert [g.size for g in groups] == [16, 16] and all(g.complete for g in groups)
    assert {g.group_id for g in groups} == {"j1/math-s0-g0000", "j1/math-s0-g0001"}
    assert all([d.trajectory.key.repetition for d in g.members] == list(range(16))
               for g in groups)
    assert all(not g.excluded and not g.infra_failures for g in groups)
    assert 'treadle_trajectories_finished_total{status="completed"}' in client.metrics()
    health = client.health()
    assert health.status == "ok" and health.engines == 2


def test_groups_come_out_as_each_completes_not_at_the_end(client: RolloutClient) -> None:
    job = client.submit({"tasks": {"workload": "coding", "trajectories": 64}})
    assert job.group_size == 16
    groups = list(client.groups(job))
    assert len(groups) == 4 and all(g.complete for g in groups)
    ends = _max_seqs(groups)
    # Each group is handed out at its last member's delivery: in that order, and all
    # but the group holding the job's last trajectory before the job ended.
    assert ends == sorted(ends) and len(set(ends)) == 4 and ends[-1] == 64
    assert sum(e < 64 for e in ends) == 3
    assert sorted(d.seq for g in groups for d in g.members) == list(range(1, 65))


def test_error_answers_carry_status_and_detail(url: str, client: RolloutClient) -> None:
    with RolloutClient(url, token="wrong") as bad:
        with pytest.raises(ServiceError) as e:
            bad.job("j1")
        assert e.value.status == 401
        assert bad.health().status == "ok"  # /healthz needs no token
    with pytest.raises(ServiceError) as e:
        client.job("nope")
    assert e.value.status == 404 and "nope" in str(e.value)
    with pytest.raises(ServiceError) as e:
        client.submit(tasks=replay_tasks("math", trajectories=0))
    assert e.value.status == 422
    assert any(loc.endswith("trajectories") for loc, _ in e.value.fields), e.value.fields
    assert str(e.value).startswith("POST /v1/jobs: 422: ")
    client.submit(tasks=replay_tasks("math", trajectories=16), job_id="dup")
    with pytest.raises(ServiceError) as e:
        client.submit(tasks=replay_tasks("math", trajectories=16), job_id="dup")
    assert e.value.status == 409
    with pytest.raises(ServiceError) as e:  # a replay-only service has no tokenizer
        client.submit(tasks=suite_tasks("math", count=2))
    assert e.value.status == 422 and "tokenizer" in str(e.value)
    with pytest.raises(ServiceError) as e:
        client.rollout("math", {"id": "q", "question": "1+1?", "answer": "2"})
    assert e.value.status == 422
    with pytest.raises(ServiceError) as e:
        list(client.trajectories("nope"))
    assert e.value.status == 404
    with pytest.raises(ValueError, match="tasks"):
        client.submit(job_id="no-tasks")


def test_cancel_delivers_the_rest_as_aborted_and_groups_exclude_them(
        client: RolloutClient) -> None:
    job = client.submit(tasks=replay_tasks("coding", trajectories=32))
    stream = client.trajectories(job.job_id)
    first = next(stream)
    state = client.cancel(job.job_id)
    assert state.status == "cancelled" and state.terminal
    rest = list(stream)
    assert [d.seq for d in [first, *rest]] == list(range(1, 33))
    groups = list(client.groups(job))
    aborted = [t for g in groups for t in g.trajectories if t.status is TrajectoryStatus.ABORTED]
    assert aborted and all(t.reward is None for t in aborted)
    for g in groups:
        assert set(g.excluded) == {t.trajectory_id for t in g.trajectories
                                   if t.status is TrajectoryStatus.ABORTED}
        assert all(r.startswith("aborted") for r in g.excluded.values())
        assert len(g.trainable) + len(g.excluded) == g.size


def test_engines_are_registered_drained_and_removed(client: RolloutClient) -> None:
    before = client.engines()
    assert len(before) == 2 and not any(e.draining for e in before)
    engine = EmulatedEngine(CostModel.named("qwen3-14b", "h100"), time_scale=0.02, seed=3)
    with serve_in_thread(engine, "extra") as srv:
        added = client.register_engine(srv.url, kind="emulated", model="extra", max_batch=64)
        assert added.label == srv.url and added.max_batch == 64
        assert added.engine_id in {e.engine_id for e in client.engines()}
        assert client.drain_engine(added.engine_id).engine_id == added.engine_id
        _wait_until(lambda: added.engine_id not in {e.engine_id for e in client.engines()})
        again = client.register_engine(srv.url, kind="emulated", model="extra")
        assert again.engine_id != added.engine_id
        client.remove_engine(again.engine_id)
        assert again.engine_id not in {e.engine_id for e in client.engines()}
    with pytest.raises(ServiceError) as e:
        client.register_engine("http://127.0.0.1:9", kind="emulated")
    assert e.value.status == 422 and "healthy" in str(e.value)
    with pytest.raises(ServiceError) as e:  # drained while idle: removed at once
        client.drain_engine(added.engine_id)
    assert e.value.status == 404
    assert len(client.engines()) == 2


def test_weights_pause_resume_and_update(tmp_path: Path) -> None:
    # No engines: the barrier has nothing to wait for or load, so it runs through.
    config = _config(tmp_path / "w.db", emulate=0)
    with running_service(config) as base, RolloutClient(base, token=TOKEN) as client:
        assert client.weights().policy_version == 0
        assert client.pause("abort").paused
        assert client.weights().paused
        resumed = client.resume(3)
        assert (resumed.policy_version, resumed.paused) == (3, False)
        updated = client.update_weights(str(tmp_path), 4)
        assert (updated.policy_version, updated.paused) == (4, False)
        with pytest.raises(ServiceError) as e:
            client.pause("sideways")
        assert e.value.status == 422

        async def main() -> None:
            async with AsyncRolloutClient(base, token=TOKEN) as c:
                assert (await c.pause("wait")).paused
                assert (await c.resume(5)) == (await c.weights())
                assert (await c.update_weights(str(tmp_path), 6)).policy_version == 6
                assert await c.engines() == []
                engine = EmulatedEngine(CostModel.named("qwen3-14b", "h100"), time_scale=0.02)
                with serve_in_thread(engine, "m") as srv:
                    added = await c.register_engine(srv.url, kind="emulated", model="m")
                    assert [e.engine_id for e in await c.engines()] == [added.engine_id]
                    assert (await c.drain_engine(added.engine_id)).engine_id == added.engine_id
                    again = await c.register_engine(srv.url, kind="emulated", model="m")
                    await c.remove_engine(again.engine_id)
                    assert again.engine_id not in {e.engine_id for e in await c.engines()}

        asyncio.run(main())


def test_infrastructure_failures_are_flagged_in_their_groups(tmp_path: Path) -> None:
    config = _config(tmp_path / "f.db", engine_wait_s=0.5, time_scale=0.05)
    with running_service(config) as base, RolloutClient(base, token=TOKEN) as client:
        job = client.submit(tasks=replay_tasks("coding", trajectories=32))
        stream = client.groups(job)
        while client.job(job.job_id).delivered < 2:
            time.sleep(0.05)
        for engine in client.engines():
            client.remove_engine(engine.engine_id)
        groups = list(stream)
        view = client.job(job.job_id)
    failed = [t for g in groups for t in g.trajectories if t.infra_failure]
    assert failed, "removing every engine left no trajectory failed"
    # The job completed, and says it was not clean.
    assert view.status == "completed" and view.infrastructure_failures == len(failed)
    assert view.reason is not None and f"{len(failed)} of 32" in view.reason
    assert all(t.reward is None and t.status is TrajectoryStatus.ERROR for t in failed)
    for g in groups:
        assert set(g.infra_failures) == {t.trajectory_id for t in g.trajectories
                                         if t.infra_failure}
        assert all(g.excluded[tid].startswith("infra_failure (engine)")
                   for tid in g.infra_failures)
        assert not set(g.infra_failures) & {t.trajectory_id for t in g.trainable}


def test_a_single_rollout_of_a_suite_task(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path / "tok")
    reply = [*tokenizer.encode("the answer is \\boxed{3}"), tokenizer.token_id("<|im_end|>")]
    fake = FakeVLLMServer(reply_ids=reply)
    with fake.serve() as engine_url:
        config = _config(tmp_path / "r.db", emulate=0, time_scale=1.0,
                         tokenizer=str(tmp_path / "tok"),
                         engines=[EngineRequest(url=engine_url, model="m")])
        with running_service(config) as base, RolloutClient(base, token=TOKEN) as client:
            t = client.rollout("math", {"id": "q1", "question": "What is 1 + 2?",
                                        "answer": "3"}, options={"python_tool": False},
                               limits={"max_turns": 2})
    assert t.status is TrajectoryStatus.COMPLETED and t.reward == 1.0
    assert t.segments and t.segments[0].response_ids == reply
    assert t.segments[0].loss_mask == [1] * len(reply)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_streams_resume_through_connections_cut_mid_line(
        url: str, asynchronous: bool, caplog: pytest.LogCaptureFixture) -> None:
    port = int(url.rsplit(":", 1)[1])
    with RolloutClient(url, token=TOKEN) as direct:
        job = direct.submit(tasks=replay_tasks("math", trajectories=48))
        list(direct.trajectories(job.job_id))  # finished: the proxy replays a long stream
    caplog.set_level(logging.WARNING, logger="treadle.client")
    # Every connection cut (FIN) or reset (RST) after 2,500 bytes of its answer.
    with FaultyProxy(port, random.Random(0), fault_share=1.0, kinds=("cut", "reset"),
                     fault_after=2500) as proxy:
        if asynchronous:
            got = asyncio.run(_read_async(proxy.url, job.job_id))
        else:
            with RolloutClient(proxy.url, token=TOKEN, retry=FAST) as c:
                got = list(c.trajectories(job.job_id))
    assert sum(proxy.faults.values()) >= 5
    assert [d.seq for d in got] == list(range(1, 49))
    assert len({d.trajectory.trajectory_id for d in got}) == 48
    assert sum("retrying" in r.getMessage() for r in caplog.records) >= 5


async def _read_async(base: str, job_id: str) -> list[Delivered]:
    async with AsyncRolloutClient(base, token=TOKEN, retry=FAST) as c:
        return [d async for d in c.trajectories(job_id)]


def test_the_async_client(url: str) -> None:
    assert AsyncRolloutClient is AsyncClientFromModule

    async def main() -> None:
        async with AsyncRolloutClient(url, token=TOKEN, retry=FAST) as c:
            assert (await c.health()).engines == 2
            job = await c.submit(tasks=replay_tasks("math", trajectories=32), job_id="a1")
            assert (job.planned, job.group_size) == (32, 16)
            groups = [g async for g in c.groups(job)]
            assert [g.complete for g in groups] == [True, True]
            ends = _max_seqs(groups)
            assert ends == sorted(ends) and ends[0] < 32
            seqs = [d.seq async for d in c.trajectories("a1", after=4)]
            assert seqs == list(range(5, 33))
            state = await c.job("a1")
            assert state.status == "completed" and state.delivered == 32
            assert len(await c.engines()) == 2
            assert "treadle_engines 2" in await c.metrics()
            assert (await c.weights()).policy_version == 0
            cancelled = await c.cancel("a1")  # cancelling a finished job changes nothing
            assert cancelled.counts["completed"] == 32
            with pytest.raises(ServiceError) as e:
                await c.job("nope")
            assert e.value.status == 404
            with pytest.raises(ServiceError) as e:
                await c.rollout("math", {"id": "q", "question": "?", "answer": "1"})
            assert e.value.status == 422

    asyncio.run(main())


def test_emulated_engines_and_replayed_tool_calls_share_one_time_scale(
        client: RolloutClient) -> None:
    # The module's service emulates at time scale 0.005: a 100 s tool call of the trace
    # is slept 0.5 s, and the record keeps the trace's (modelled) seconds.
    trace = [{"id": "t", "group": "g", "prompt_tokens": 64, "turns": [
        {"output_tokens": 32, "tool_latency_s": 100.0, "tool_output_tokens": 16},
        {"output_tokens": 32, "tool_latency_s": 0, "tool_output_tokens": 0}]}]
    job = client.submit(tasks=replay_tasks(trace=trace))
    assert job.group_size == {f"{job.job_id}/g": 1}
    ((group),) = list(client.groups(job))
    (t,) = group.trajectories
    call = t.turns[0].tool_call
    assert call is not None and call.latency_s == pytest.approx(100.0, rel=0.05)
    assert t.timings.tool_s == call.latency_s
    state = client.job(job.job_id)
    assert state.finished_at is not None
    assert state.finished_at - state.created_at < 50.0  # real seconds: far under 100

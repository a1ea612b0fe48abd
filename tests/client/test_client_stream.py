"""The HTTP client's I/O-free parts: the stream cursor, retries, groups, requests,
errors; and its retry rules over a scripted transport."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from client_helpers import error, traj

from treadle.client import (
    AsyncRolloutClient,
    GroupError,
    RetryPolicy,
    RolloutClient,
    ServiceError,
    ServiceProtocolError,
    ServiceUnavailable,
    replay_tasks,
    suite_tasks,
    training_sequences,
)
from treadle.client.groups import GroupCollector
from treadle.client.stream import Retries, StreamCursor
from treadle.client.wire import Delivered, group_sizes, submit_body
from treadle.store.errors import RecordError
from treadle.store.record import dumps_record, trajectory_to_record
from treadle.types import Trajectory

NO_WAIT = RetryPolicy(attempts=4, backoff_s=0.0, max_backoff_s=0.0)


def _line(seq: int, t: Trajectory | None = None) -> bytes:
    t = t or traj(f"t{seq}", "g", seq)
    return f'{{"seq":{seq},"trajectory":{dumps_record(trajectory_to_record(t))}}}\n'.encode()


def _delivered(seq: int, t: Trajectory) -> Delivered:
    return Delivered(seq, t)


# -- the cursor ------------------------------------------------------------------------------


def test_the_cursor_reads_lines_split_across_chunks_and_moves_on() -> None:
    data = _line(1) + _line(2) + _line(3)
    cursor = StreamCursor("j", 0)
    out = []
    for i in range(0, len(data), 37):  # chunks that cut lines anywhere
        out += cursor.feed(data[i:i + 37])
    assert [d.seq for d in out] == [1, 2, 3] and cursor.after == 3 and not cursor.cut
    assert out[1].trajectory.trajectory_id == "t2"


def test_a_line_cut_by_a_dropped_connection_is_read_again_not_twice() -> None:
    cursor = StreamCursor("j", 0)
    first = _line(1) + _line(2)[:50]
    assert [d.seq for d in cursor.feed(first)] == [1]
    assert cursor.cut  # ended inside line 2
    cursor.reconnect()  # the next connection resumes after seq 1
    assert [d.seq for d in cursor.feed(_line(2) + _line(3))] == [2, 3]
    assert [d.seq for d in cursor.feed(_line(2) + _line(4))] == [4]  # 2 again: skipped


def test_a_gap_or_garbage_in_the_stream_is_a_protocol_error() -> None:
    with pytest.raises(ServiceProtocolError, match=r"2\.\.2 are missing"):
        StreamCursor("j", 1).feed(_line(3))
    with pytest.raises(ServiceProtocolError, match="not JSON"):
        StreamCursor("j").feed(b"<html>\n")
    with pytest.raises(ServiceProtocolError, match="seq, trajectory"):
        StreamCursor("j").feed(b'{"seq": "1", "trajectory": {}}\n')
    bad = json.loads(_line(1))
    bad["trajectory"]["output_tokens"] += 1
    with pytest.raises(ServiceProtocolError, match="output_tokens") as e:
        StreamCursor("j").feed(json.dumps(bad).encode() + b"\n")
    assert isinstance(e.value.__cause__, RecordError)
    with pytest.raises(ValueError):
        StreamCursor("j", -1)


# -- retries ----------------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_bound_and_respects_retry_after() -> None:
    policy = RetryPolicy(attempts=10, backoff_s=0.25, max_backoff_s=5.0)
    assert [policy.delay(n) for n in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert policy.delay(1, retry_after_s=3.0) == 3.0
    assert policy.delay(1, retry_after_s=60.0) == 5.0
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


def test_the_default_patience_is_five_minutes_of_waiting_not_a_count() -> None:
    # A follower with all defaults rides out a service that is down for five minutes
    # (ten quick failures used to end it after ~28 s).
    policy = RetryPolicy()
    retries = Retries(policy, "GET /x")
    waits: list[float] = []
    with pytest.raises(ServiceUnavailable, match="gave up"):
        while True:
            waits.append(retries.failed(httpx.ConnectError("refused")))
    assert 300.0 <= sum(waits) < 300.0 + policy.max_backoff_s
    # A policy's own patience, and progress starting it again.
    short = Retries(RetryPolicy(patience_s=10.0), "GET /x")
    for _ in range(policy.attempts - 1):  # 20 s waited: the next failure gives up...
        short.failed(httpx.ConnectError("refused"))
    short.progress()  # ...but a success came first
    assert short.failed(httpx.ConnectError("refused")) == policy.backoff_s
    with pytest.raises(ValueError):
        RetryPolicy(patience_s=-1.0)


def test_retries_give_up_after_the_attempts_in_a_row_and_progress_resets_them() -> None:
    retries = Retries(RetryPolicy(attempts=3, backoff_s=0.0, max_backoff_s=0.0), "GET /x")
    cause = httpx.ConnectError("refused")
    retries.failed(cause)
    retries.progress()
    retries.failed(cause)
    retries.failed(cause)
    with pytest.raises(ServiceUnavailable, match="GET /x: gave up after 3 attempts") as e:
        retries.failed(cause)
    assert e.value.attempts == 3 and e.value.cause is cause


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_an_unreachable_service_is_service_unavailable_after_the_retries() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with RolloutClient(url, retry=NO_WAIT) as client:
        with pytest.raises(ServiceUnavailable) as e:
            client.job("j")
        assert e.value.attempts == 4 and isinstance(e.value.cause, httpx.ConnectError)
        with pytest.raises(ServiceUnavailable):
            list(client.trajectories("j"))

    async def main() -> None:
        async with AsyncRolloutClient(url, retry=NO_WAIT) as client:
            with pytest.raises(ServiceUnavailable):
                await client.health()
            with pytest.raises(ServiceUnavailable):
                [d async for d in client.trajectories("j")]

    asyncio.run(main())


class _Script:
    """A scripted httpx transport: answers (or raises) in turn, records requests."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _job_answer() -> httpx.Response:
    return httpx.Response(201, json={"job_id": "j", "planned": 16})


def test_a_post_lost_after_sending_is_not_repeated_but_a_busy_answer_is() -> None:
    script = _Script(httpx.ReadError("reset"))
    with RolloutClient("http://svc", transport=httpx.MockTransport(script),
                       retry=NO_WAIT) as client, \
            pytest.raises(ServiceUnavailable, match="may have been carried out"):
        client.submit(tasks=replay_tasks("math", trajectories=16))
    assert len(script.requests) == 1
    script = _Script(httpx.Response(503, headers={"retry-after": "0"}, json={"detail": "busy"}),
                     httpx.ConnectError("refused"), _job_answer())
    with RolloutClient("http://svc", transport=httpx.MockTransport(script), retry=NO_WAIT,
                       token="tok") as client:
        job = client.submit(tasks=replay_tasks("math", trajectories=16), job_id="j")
    assert (job.job_id, job.planned, job.group_size) == ("j", 16, 16)
    assert len(script.requests) == 3
    assert all(r.headers["authorization"] == "Bearer tok" for r in script.requests)
    body = json.loads(script.requests[-1].content)
    assert body == {"tasks": {"workload": "math", "trajectories": 16}, "job_id": "j"}


def test_a_get_is_repeated_after_a_dropped_connection_and_a_gateway_error() -> None:
    view = {"job_id": "j", "status": "running", "reason": None, "planned": 4, "delivered": 1,
            "counts": {"completed": 1}, "progress": 0.25, "created_at": 1.0,
            "started_at": 2.0, "finished_at": None, "running": 3, "queued": 0,
            "added_later": True}
    script = _Script(httpx.ReadError("reset"), httpx.Response(502, text="bad gateway"),
                     httpx.Response(200, json=view))
    with RolloutClient("http://svc", transport=httpx.MockTransport(script),
                       retry=NO_WAIT) as client:
        state = client.job("j")
    assert state.delivered == 1 and not state.terminal and len(script.requests) == 3
    script = _Script(httpx.Response(200, json={"job_id": "j"}))
    with RolloutClient("http://svc", transport=httpx.MockTransport(script)) as client, \
            pytest.raises(ServiceProtocolError, match="lacks"):
        client.job("j")


def test_a_stream_that_ends_before_its_job_is_resumed() -> None:
    running = {"job_id": "j", "status": "running", "reason": None, "planned": 2,
               "delivered": 1, "counts": {}, "progress": 0.5, "created_at": 1.0,
               "started_at": 2.0, "finished_at": None, "running": 1, "queued": 0}
    done = {**running, "status": "completed", "delivered": 2, "progress": 1.0}
    script = _Script(httpx.Response(200, content=_line(1)), httpx.Response(200, json=running),
                     httpx.Response(200, content=_line(2)), httpx.Response(200, json=done))
    with RolloutClient("http://svc", transport=httpx.MockTransport(script),
                       retry=NO_WAIT) as client:
        assert [d.seq for d in client.trajectories("j")] == [1, 2]
    streams = [r for r in script.requests if r.url.path.endswith("/trajectories")]
    assert [r.url.params["after"] for r in streams] == ["0", "1"]
    assert all(r.url.params["follow"] == "true" for r in streams)


def test_error_answers_name_the_call_the_status_and_the_fields() -> None:
    detail = [{"loc": ["body", "tasks", "count"], "msg": "Input should be greater than 0",
               "type": "greater_than"}]
    script = _Script(httpx.Response(422, json={"detail": detail}),
                     httpx.Response(404, json={"detail": "no job 'x'"}),
                     httpx.Response(500, text="oops"))
    with RolloutClient("http://svc", transport=httpx.MockTransport(script),
                       retry=NO_WAIT) as client:
        with pytest.raises(ServiceError) as e:
            client.submit(tasks=suite_tasks("math", count=0))
        assert str(e.value) == ("POST /v1/jobs: 422: body.tasks.count: Input should be "
                                "greater than 0")
        assert e.value.fields == [("body.tasks.count", "Input should be greater than 0")]
        with pytest.raises(ServiceError, match="404: no job 'x'") as e:
            client.cancel("x")
        assert e.value.fields == []
        with pytest.raises(ServiceError, match="500: oops"):  # not retried: a bug to see
            client.engines()
    assert len(script.requests) == 3


# -- requests -----------------------------------------------------------------------------------


def test_requests_leave_out_what_is_not_set_and_keywords_win() -> None:
    assert suite_tasks("math", count=4) == {"suite": "math", "count": 4}
    assert replay_tasks(trace=[{"id": "a"}]) == {"trace": [{"id": "a"}]}
    body = submit_body({"tasks": {"suite": "math", "count": 2}, "priority": 1},
                       {"priority": 5, "job_id": None})
    assert body == {"tasks": {"suite": "math", "count": 2}, "priority": 5}
    with pytest.raises(ValueError, match="tasks"):
        submit_body(None, {"job_id": "j"})


def test_group_sizes_follow_the_request_and_the_service_defaults() -> None:
    from treadle.service.schemas import JobRequest, ReplayTasks

    # The client's defaults are the service's: read them from its schema.
    samples = JobRequest.model_fields["samples_per_task"].default
    group = ReplayTasks.model_fields["group_size"].default
    assert group_sizes({"tasks": suite_tasks("math", count=4)}, "j") == samples
    assert group_sizes({"tasks": suite_tasks("math", count=4), "samples_per_task": 8}, "j") == 8
    assert group_sizes({"tasks": replay_tasks("math", trajectories=32)}, "j") == group
    assert group_sizes({"tasks": replay_tasks("math", trajectories=32, group_size=4)}, "j") == 4
    trace: list[dict[str, Any]] = [{"id": "a", "group": "g1"}, {"id": "b", "group": "g2"},
                                   {"id": "c", "group": "g1"}]
    assert group_sizes({"tasks": replay_tasks(trace=trace)}, "j") == {"j/g1": 2, "j/g2": 1}


# -- groups ----------------------------------------------------------------------------------------


def test_a_group_comes_out_when_its_last_member_arrives() -> None:
    collector = GroupCollector(3)
    order = [("a", 2), ("b", 0), ("a", 0), ("b", 1), ("a", 1), ("b", 2)]
    out = [collector.add(_delivered(i + 1, traj(f"{g}{r}", g, r)))
           for i, (g, r) in enumerate(order)]
    assert [None if g is None else g.group_id for g in out] == [None] * 4 + ["a", "b"]
    first = out[4]
    assert first is not None and first.complete
    assert [d.trajectory.key.repetition for d in first.members] == [0, 1, 2]
    assert collector.rest() == []
    with pytest.raises(GroupError, match="more than 3"):
        collector.add(_delivered(7, traj("a9", "a", 9)))


def test_groups_of_declared_sizes_and_the_ones_left_short() -> None:
    collector = GroupCollector({"a": 1, "b": 2})
    assert collector.add(_delivered(1, traj("b0", "b", 0))) is None
    whole = collector.add(_delivered(2, traj("a0", "a", 0)))
    assert whole is not None and whole.group_id == "a"
    (short,) = collector.rest()
    assert short.group_id == "b" and not short.complete and short.size == 2
    with pytest.raises(GroupError, match="not among"):
        collector.add(_delivered(3, traj("c0", "c", 0)))
    with pytest.raises(ValueError):
        GroupCollector(0)


def test_an_infrastructure_failure_is_flagged_and_never_scored() -> None:
    members = [traj("t0", "g", 0, 1.0), error("t1", "g", 1), traj("t2", "g", 2, 0.0)]
    collector = GroupCollector(3)
    group = None
    for i, t in enumerate(members):
        group = collector.add(_delivered(i + 1, t))
    assert group is not None
    assert group.infra_failures == ["t1"]
    assert set(group.excluded) == {"t1"} and group.excluded["t1"].startswith("infra_failure")
    assert [t.trajectory_id for t in group.trainable] == ["t0", "t2"]
    batch = group.batch()
    assert [s.trajectory_id for s in batch.sequences] == ["t0", "t2"]
    assert [e.trajectory_id for e in batch.exclusions] == ["t1"]
    # The baseline is over the members that ran: as if the failure had never been there.
    alone = training_sequences([members[0], members[2]])
    assert [s.advantage for s in batch.sequences] == [s.advantage for s in alone.sequences]
    assert all(s.reward is not None for s in batch.sequences)
    assert len(group.batch(drop_group_on_failure=True).sequences) == 0

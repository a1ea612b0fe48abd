"""Continuous jobs live on emulated engines: groups taken as a trainer needs them,
across weight updates in each mode, within a staleness bound, across a restart of
the service; `take(n)`'s semantics and the 422s of bad settings."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service, until

from treadle.client import RolloutClient, ServiceError, replay_tasks
from treadle.client.groups import Group
from treadle.service.state import ServiceConfig

pytestmark = pytest.mark.integration
TAKE_S = 180.0  # a take that never gets its groups fails the test rather than hang it


def _config(tmp_path: Path, time_scale: float = 0.02) -> ServiceConfig:
    return ServiceConfig(db=str(tmp_path / "c.db"), token="t", emulate=1,
                         time_scale=time_scale, policy="verl")


def _running(client: RolloutClient, job_id: str, db: Path) -> None:
    """Until a group of the job runs, or, if one ran and ended between two looks, until
    it completed (the update then falls between groups). The job's store is written at
    a running trajectory's turns (the journal) and at its end, and each write brings a
    look (`until`)."""
    done = client.job(job_id).counts["completed"]

    def running_or_past() -> bool:
        view = client.job(job_id)
        return view.running > 0 or view.counts["completed"] > done
    until(running_or_past, lambda: None, db)


def _rows(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _discarded_by_version(db: Path, job_id: str) -> dict[int, int]:
    out: Counter[int] = Counter()
    for (payload,) in _rows(db, "SELECT payload FROM events WHERE job_id = ? AND "
                                "kind = 'stale_restart'", job_id):
        p = json.loads(payload)
        out[p["policy_version"]] += p["tokens_discarded"]
    return dict(out)


def _check_delivered(db: Path, job_id: str, taken: list[Group], budget: int) -> None:
    """Every group taken once, each the budget's; every delivery on the job's stream
    either a member of a taken group or a member superseded by its restart."""
    assert [g.taken for g in taken] == list(range(1, budget + 1))
    assert len({g.group_id for g in taken}) == budget
    members = [d.trajectory.trajectory_id for g in taken for d in g.members]
    assert len(members) == len(set(members))
    assert all(g.complete for g in taken)
    rows = _rows(db, "SELECT trajectory_id, seq, superseded FROM trajectories WHERE "
                     "job_id = ?", job_id)
    assert all(seq is not None for _, seq, _ in rows)  # nothing left unfinished
    current = {tid for tid, _, superseded in rows if not superseded}
    assert current == set(members)  # none lost: every current member was taken
    seqs = [seq for _, seq, _ in rows]
    assert sorted(seqs) == list(range(1, len(rows) + 1))  # each delivered once


@pytest.mark.parametrize("mode", ["abort", "drain", "keep"])
def test_a_continuous_job_over_five_updates(tmp_path: Path, mode: str) -> None:
    """A trainer's loop: take a step's group, push new weights while the next one
    runs. One group in flight, taken whole before the next update, so none goes
    stale and nothing is discarded (the emulated engine's abort returns the partial
    output, so no mode loses tokens there). (With more in flight, a group launched
    while a take waits may finish first and carry an older one past the bound:
    `test_the_bound_restarts_...` shows what happens then.)"""
    in_flight, steps, bound = 1, 6, 1
    with running_service(_config(tmp_path)) as url, RolloutClient(url, token="t") as client:
        job = client.submit({"continuous": {"in_flight": in_flight, "budget": in_flight * steps,
                                            "max_staleness": bound}},
                            tasks=replay_tasks("short", trajectories=8, seed=3, group_size=2))
        taken: list[Group] = []
        served_at_take: list[int] = []
        for version in range(1, steps + 1):
            got = client.take(job.job_id, in_flight, timeout_s=TAKE_S)
            taken += got
            served_at_take += [version - 1] * len(got)
            if version < steps:  # five updates, each while the next groups run
                _running(client, job.job_id, tmp_path / "c.db")
                client.update_weights(str(tmp_path), version, mode=mode, timeout_s=60)
        # The budget is spent: the job has ended.
        assert client.take(job.job_id, 1, timeout_s=TAKE_S) == []
        metrics = client.metrics()
        state = client.job(job.job_id)
    db = tmp_path / "c.db"
    assert state.status == "completed" and state.groups_taken == in_flight * steps
    _check_delivered(db, job.job_id, taken, in_flight * steps)
    for group, served in zip(taken, served_at_take, strict=True):
        assert not group.stale
        for d in group.members:
            span = d.trajectory.policy_span
            assert span is not None and served - span[0] <= bound
    assert _discarded_by_version(db, job.job_id) == {}  # 0 tokens discarded per update
    assert "treadle_tokens_discarded_total 0" in metrics
    assert f'treadle_weight_update_seconds_count{{mode="{mode}"}} 5' in metrics


def test_the_bound_restarts_what_goes_stale_and_counts_what_it_discards(
        tmp_path: Path) -> None:
    """Over-provisioned, bound 0: groups carried across an update are out of the
    bound at once; they are run again, their tokens counted as discarded per update,
    and nothing handed out has a token older than the version served."""
    budget = 16  # 10 taken over the updates, groups always running
    with running_service(_config(tmp_path)) as url, RolloutClient(url, token="t") as client:
        job = client.submit({"continuous": {"in_flight": 2, "overprovision": 1.0,
                                            "budget": budget, "max_staleness": 0}},
                            tasks=replay_tasks("math", trajectories=12, seed=5, group_size=2))
        taken: list[Group] = []
        for version in range(1, 6):
            got = client.take(job.job_id, 2, timeout_s=TAKE_S)
            for g in got:
                for d in g.members:
                    span = d.trajectory.policy_span
                    assert span is not None and span[0] >= version - 1
            taken += got
            _running(client, job.job_id, tmp_path / "c.db")
            client.update_weights(str(tmp_path), version, mode="keep", timeout_s=60)
        while len(taken) < budget:
            got = client.take(job.job_id, budget - len(taken), timeout_s=TAKE_S)
            assert got, "the job ended before its budget was taken"
            for g in got:
                assert all(d.trajectory.policy_span == (5, 5) for d in g.members)
            taken += got
        metrics = client.metrics()
    db = tmp_path / "c.db"
    _check_delivered(db, job.job_id, taken, budget)
    discarded = _discarded_by_version(db, job.job_id)
    assert discarded and set(discarded) <= set(range(1, 6))
    total = sum(discarded.values())
    assert f"treadle_tokens_discarded_total {total}" in metrics
    restarted = _rows(db, "SELECT count(*) FROM trajectories WHERE job_id = ? AND "
                          "superseded = 1", job.job_id)[0][0]
    stopped = _rows(db, "SELECT count(*) FROM trajectories WHERE job_id = ? AND "
                        "superseded = 1 AND status = 'aborted'", job.job_id)[0][0]
    assert stopped  # members running at an update were stopped there, not run on
    assert restarted == sum(1 for (_,) in _rows(
        db, "SELECT payload FROM events WHERE job_id = ? AND kind = 'stale_restart'",
        job.job_id))


def test_flag_hands_stale_groups_out_flagged(tmp_path: Path) -> None:
    """on_stale flag: a group out of the bound is handed out as it is, flagged."""
    with running_service(_config(tmp_path)) as url, RolloutClient(url, token="t") as client:
        job = client.submit({"continuous": {"in_flight": 2, "budget": 2, "max_staleness": 0,
                                            "on_stale": "flag"}},
                            tasks=replay_tasks("short", trajectories=4, seed=1, group_size=2))
        until(lambda: client.job(job.job_id).counts["completed"] == 4, lambda: None,
              tmp_path / "c.db")
        client.update_weights(str(tmp_path), 1, mode="drain", timeout_s=60)
        got = client.take(job.job_id, 2, timeout_s=TAKE_S)
        with httpx.Client(base_url=url, headers={"authorization": "Bearer t"},
                          timeout=60) as raw:
            readback = raw.get(f"/v1/jobs/{job.job_id}/taken").json()
    assert [g.stale for g in got] == [True, True]
    assert [g["stale"] for g in readback] == [True, True]
    assert all(d.trajectory.policy_span == (0, 0) for g in got for d in g.members)


def test_nothing_is_lost_or_handed_out_twice_across_a_restart(tmp_path: Path) -> None:
    """The service stopped and started again on the same store mid-stream, groups in
    flight: the trainer's client carries on, every group taken once."""
    config, budget = _config(tmp_path), 8
    with running_service(config) as url, RolloutClient(url, token="t") as client:
        job = client.submit({"continuous": {"in_flight": 2, "overprovision": 0.5,
                                            "budget": budget}},
                            tasks=replay_tasks("math", trajectories=8, seed=2, group_size=2))
        first = client.take(job.job_id, 3, timeout_s=TAKE_S)
        _running(client, job.job_id, tmp_path / "c.db")
    with running_service(config) as url, RolloutClient(url, token="t") as client:
        again = client.take(job.job_id, budget - 3, timeout_s=TAKE_S)
        assert client.take(job.job_id, 1, timeout_s=TAKE_S) == []
        state = client.job(job.job_id)
    taken = first + again
    assert state.status == "completed"
    _check_delivered(tmp_path / "c.db", job.job_id, taken, budget)
    recovered = _rows(tmp_path / "c.db", "SELECT payload FROM events WHERE job_id = ? "
                                         "AND kind = 'recovered'", job.job_id)
    assert recovered  # groups were in flight at the restart, and were run again


def test_take_n_semantics(tmp_path: Path) -> None:
    """take(n) blocks for n complete groups; the same take call again gets the same
    groups, another call other ones; every client takes after the groups taken; a
    job that ended gives fewer; a job that is not continuous is a 422."""
    with running_service(_config(tmp_path)) as url, RolloutClient(url, token="t") as client:
        job = client.submit({"continuous": {"in_flight": 3, "budget": 5}},
                            tasks=replay_tasks("short", trajectories=6, seed=4, group_size=2))
        three = client.take(job.job_id, 3, timeout_s=TAKE_S)
        assert [g.taken for g in three] == [1, 2, 3] and all(g.complete for g in three)
        path = f"/v1/jobs/{job.job_id}/take"
        with httpx.Client(base_url=url, headers={"authorization": "Bearer t"},
                          timeout=60) as raw:
            first = raw.post(path, json={"take_id": "a", "n": 1, "wait_s": 30}).json()
            again = raw.post(path, json={"take_id": "a", "n": 1, "wait_s": 30}).json()
            assert [g["taken"] for g in first["groups"]] == [4]
            assert again["groups"] == first["groups"]  # a retry: the same group
            readback = raw.get(f"/v1/jobs/{job.job_id}/taken", params={"after": 3}).json()
            assert [g["group_id"] for g in readback] == [first["groups"][0]["group_id"]]
        with RolloutClient(url, token="t") as other:
            # Another trainer: only what is left.
            rest = other.take(job.job_id, 5, timeout_s=TAKE_S)
        assert [g.taken for g in rest] == [5]
        assert client.take(job.job_id, 1, timeout_s=TAKE_S) == []  # ended: nothing more
        assert client.job(job.job_id).groups_taken == 5
        plain = client.submit(tasks=replay_tasks("short", trajectories=2, seed=1,
                                                 group_size=2))
        with pytest.raises(ServiceError) as refused:
            client.take(plain.job_id, 1)
    assert refused.value.status == 422


@pytest.mark.parametrize(("body", "where"), [
    ({"continuous": {"in_flight": 0}}, "in_flight"),
    ({"continuous": {"in_flight": 2, "on_stale": "cut"}}, "on_stale needs max_staleness"),
    ({"continuous": {"in_flight": 2, "max_staleness": -1}}, "max_staleness"),
    ({"continuous": {"in_flight": 2, "on_stale": "drop", "max_staleness": 1}}, "on_stale"),
    ({"continuous": {"in_flight": 2, "budget": 0}}, "budget"),
    ({"continuous": {"in_flight": 2, "overprovision": -0.5}}, "overprovision"),
    ({"continuous": {"in_flight": 2}, "max_policy_version": 3}, "no max_policy_version"),
    ({"continuous": {"in_flight": 2, "extra": 1}}, "extra"),
    ({"continuous": {"in_flight": 2048}, "tasks": {
        "workload": "short", "trajectories": 64, "group_size": 64}},
     "131072 trajectories launched"),
])
def test_bad_settings_are_422s(tmp_path: Path, body: dict[str, Any], where: str) -> None:
    config = ServiceConfig(db=str(tmp_path / "c.db"), token="t", policy="verl")
    with running_service(config) as url, httpx.Client(base_url=url, timeout=30, headers={
            "authorization": "Bearer t"}) as raw:
        answer = raw.post("/v1/jobs", json={
            "tasks": {"workload": "short", "trajectories": 2, "group_size": 2}, **body})
        take = raw.post("/v1/jobs/x/take", json={"take_id": "a/b", "n": 0})
    assert answer.status_code == 422, answer.text
    assert where in answer.text
    assert take.status_code in (404, 422)

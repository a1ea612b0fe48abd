"""A service killed with SIGKILL mid-job and started again on the same store finishes
the job, and a client that resumes its stream from its cursor gets every trajectory
exactly once: by hand over HTTP, and with the sync and async clients, which resume
on their own while they iterate."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from treadle.bench.faults import ServiceProcess
from treadle.client import AsyncRolloutClient, Delivered, RetryPolicy, RolloutClient, replay_tasks

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "restart-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _service(tmp_path: Path, *extra: str) -> ServiceProcess:
    """`treadle serve` on two emulated engines (policy verl), in its own session."""
    return ServiceProcess(tmp_path / "svc.db", tmp_path / "svc.log", TOKEN,
                          ["--emulate", "2", "--time-scale", "0.05", "--policy", "verl",
                           *extra])


def _read(url: str, job: str, after: int, until: int | None) -> list[dict[str, Any]]:
    """Stream from `after`; stop after `until` lines (None: the end of the job)."""
    out: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{url}/v1/jobs/{job}/trajectories", headers=AUTH,
                      params={"after": after, "follow": "true"}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                out.append(json.loads(line))
                if until is not None and len(out) >= until:
                    break
    return out


@pytest.mark.parametrize("store", ["--no-store-process", "--store-process"])
def test_kill_9_mid_job_then_restart_delivers_every_trajectory_once(tmp_path: Path,
                                                                    store: str) -> None:
    # With --store-process the store's own process outlives the kill by a moment (until
    # it sees its socket closed) while the new service opens the same file.
    service = _service(tmp_path, store)
    url = service.url
    service.start()
    try:
        r = httpx.post(f"{url}/v1/jobs", headers=AUTH, timeout=30, json={
            "tasks": {"workload": "coding", "trajectories": 64}, "job_id": "r1"})
        assert r.status_code == 201, r.text
        before = _read(url, "r1", 0, until=16)
        assert httpx.get(f"{url}/v1/jobs/r1", headers=AUTH).json()["status"] == "running"
    finally:
        service.kill()
    cursor = before[-1]["seq"]
    service.start()
    try:
        after = _read(url, "r1", cursor, until=None)
        view = httpx.get(f"{url}/v1/jobs/r1", headers=AUTH).json()
    finally:
        service.stop()
    seqs = [x["seq"] for x in before + after]
    ids = [x["trajectory"]["trajectory_id"] for x in before + after]
    assert seqs == list(range(1, 65)) and len(set(ids)) == 64
    assert view["status"] == "completed" and view["counts"]["completed"] == 64
    # The trajectories that were running at the kill ran again, with their attempt counted.
    assert any(x["trajectory"]["attempt"] >= 1 for x in after)
    assert all(x["trajectory"]["attempt"] == 0 for x in before)


PATIENT = RetryPolicy(attempts=80, backoff_s=0.1, max_backoff_s=1.0)  # ~75 s of downtime


class _Retries(logging.Handler):
    """Sets `seen` once `n` records saying "retrying" have been logged (an event)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying" in record.getMessage():
            self.n -= 1
            if self.n <= 0:
                self.seen.set()


def test_clients_iterating_across_a_kill_9_and_restart_get_every_trajectory_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    service = _service(tmp_path)
    url = service.url
    caplog.set_level(logging.WARNING, logger="treadle.client")
    retries = _Retries(2)
    logging.getLogger("treadle.client").addHandler(retries)
    retried = retries.seen
    service.start()
    from_async: list[list[Delivered]] = []

    async def read_async() -> list[Delivered]:
        async with AsyncRolloutClient(url, token=TOKEN, retry=PATIENT) as c:
            return [d async for d in c.trajectories("r2")]

    def restart() -> None:
        # Once the clients have met the refused connection (each logs its retries).
        retried.wait()  # set by the log handler at the second retry: an event
        service.start()

    try:
        with RolloutClient(url, token=TOKEN, retry=PATIENT) as client:
            client.submit(tasks=replay_tasks("coding", trajectories=64), job_id="r2")
            reader = threading.Thread(target=lambda: from_async.append(asyncio.run(read_async())))
            reader.start()
            got: list[Delivered] = []
            restarter = threading.Thread(target=restart)
            for delivered in client.trajectories("r2"):
                got.append(delivered)
                if len(got) == 16:
                    service.kill()
                    restarter.start()
            reader.join(120)
            restarter.join(60)
            view = client.job("r2")
    finally:
        logging.getLogger("treadle.client").removeHandler(retries)
        service.stop()
    assert service.starts == 2, "the service was not restarted"
    assert [d.seq for d in got] == list(range(1, 65))
    assert len({d.trajectory.trajectory_id for d in got}) == 64
    assert view.status == "completed" and view.delivered == 64
    assert any(d.trajectory.attempt >= 1 for d in got[16:])  # re-run after the kill
    assert from_async and [(d.seq, d.trajectory.trajectory_id) for d in from_async[0]] == [
        (d.seq, d.trajectory.trajectory_id) for d in got]
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert any("ConnectError" in m for m in retries), retries  # it waited out the downtime

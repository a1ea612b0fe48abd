"""A service killed with SIGKILL mid-job and started again on the same store finishes
the job, and a client that resumes its stream from its cursor gets every trajectory
exactly once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "restart-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _serve(db: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "treadle", "serve", "--port", str(port), "--db", str(db),
             "--token", TOKEN, "--emulate", "2", "--time-scale", "0.05", "--policy", "verl",
             "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json()["engines"] == 2:
                return proc
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"service not up; log:\n{log.read_text()[-2000:]}")


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


def test_kill_9_mid_job_then_restart_delivers_every_trajectory_once(tmp_path: Path) -> None:
    db, log, port = tmp_path / "svc.db", tmp_path / "svc.log", _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(db, port, log)
    try:
        r = httpx.post(f"{url}/v1/jobs", headers=AUTH, timeout=30, json={
            "tasks": {"workload": "coding", "trajectories": 64}, "job_id": "r1"})
        assert r.status_code == 201, r.text
        before = _read(url, "r1", 0, until=16)
        assert httpx.get(f"{url}/v1/jobs/r1", headers=AUTH).json()["status"] == "running"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    cursor = before[-1]["seq"]
    proc = _serve(db, port, log)
    try:
        after = _read(url, "r1", cursor, until=None)
        view = httpx.get(f"{url}/v1/jobs/r1", headers=AUTH).json()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    seqs = [x["seq"] for x in before + after]
    ids = [x["trajectory"]["trajectory_id"] for x in before + after]
    assert seqs == list(range(1, 65)) and len(set(ids)) == 64
    assert view["status"] == "completed" and view["counts"]["completed"] == 64
    # The trajectories that were running at the kill ran again, with their attempt counted.
    assert any(x["trajectory"]["attempt"] >= 1 for x in after)
    assert all(x["trajectory"]["attempt"] == 0 for x in before)

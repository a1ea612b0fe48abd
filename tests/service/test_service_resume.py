"""A service killed with SIGKILL mid-job resumes every unfinished trajectory from its
last journaled turn: after the restart its record's turns up to the crash are the
journal's (engine, seconds, versions, tokens), it says where it resumed, and nothing
journaled is sampled again; `--resume-from prompt` (the before) discards them.
Replayed multi-turn coding trajectories on emulated engines, in a `treadle serve`
process."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import until

from treadle.agent.journal import FROM_PROMPT, JournaledTurn
from treadle.bench.faults import ServiceProcess
from treadle.store import NotFound, Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "resume-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
N = 48


def _journal(db: Path) -> dict[str, list[JournaledTurn]]:
    """The unfinished trajectories' journaled turns, read from the dead service's file."""
    with Store(db) as store:
        ids = [s.trajectory_id for s in store.unfinished("r")]
        return {tid: [JournaledTurn.decode(b) for b in store.journaled("r", tid).turns]
                for tid in ids}


def _journaled_turns(db: Path) -> int:
    with Store(db) as store:
        try:
            unfinished = store.unfinished("r")
        except NotFound:  # (not submitted yet)
            return 0
        return sum(len(store.journaled("r", s.trajectory_id).turns) for s in unfinished)


def _over(db: Path) -> str | None:
    """Why the journal cannot fill any more (the job ended), if so."""
    with Store(db) as store, contextlib.suppress(NotFound):
        if store.job("r").status.terminal:
            return "the job ended before a quarter of it had turns journaled"
    return None


def _records(url: str) -> list[dict[str, Any]]:
    with httpx.stream("GET", f"{url}/v1/jobs/r/trajectories", headers=AUTH,
                      params={"follow": "true"}, timeout=300) as r:
        assert r.status_code == 200
        return [json.loads(line)["trajectory"] for line in r.iter_lines() if line]


@pytest.mark.parametrize("resume_from", ["turn", "prompt"])
def test_a_kill_9_costs_the_turns_in_flight_only(tmp_path: Path, resume_from: str) -> None:
    db = tmp_path / "svc.db"
    service = ServiceProcess(db, tmp_path / "svc.log", TOKEN, [
        "--emulate", "2", "--time-scale", "0.1", "--policy", "treadle",
        "--resume-from", resume_from])
    service.start()
    try:
        r = httpx.post(f"{service.url}/v1/jobs", headers=AUTH, timeout=30, json={
            "tasks": {"workload": "coding", "trajectories": N}, "job_id": "r"})
        assert r.status_code == 201, r.text
        # Kill once a good share of the running trajectories have turns journaled.
        until(lambda: _journaled_turns(db) >= N // 4, lambda: _over(db), db, service.proc)
    finally:
        service.kill()
    journal = _journal(db)
    # (Some finished between the last look and the kill: their journals went with them.)
    assert sum(len(turns) for turns in journal.values()) > 0
    service.start()
    try:
        records = _records(service.url)
    finally:
        service.stop()
    assert len(records) == N and len({r["trajectory_id"] for r in records}) == N
    assert all(r["status"] == "completed" for r in records)
    by_id = {r["trajectory_id"]: r for r in records}
    for tid, turns in journal.items():
        record = by_id[tid]
        assert record["attempt"] == 1, tid
        [point] = record["resumed"]
        if resume_from == "prompt":
            assert (point["turn"], point["discarded_turns"], point["reason"]) == (
                0, len(turns), FROM_PROMPT)
            assert point["discarded_tokens"] == sum(t.tokens for t in turns)
            continue
        # Every journaled turn kept, as it was recorded before the crash.
        assert (point["turn"], point["discarded_turns"], point["reason"]) == (
            len(turns), 0, ""), tid
        for kept, turn in zip(record["turns"], turns, strict=False):
            out = turn.output
            assert (kept["output_tokens"], kept["engine_id"], kept["policy_version"],
                    kept["queued_s"], kept["generating_s"]) == (
                len(out.output_ids), out.engine_id, out.last_version, out.queued_s,
                out.generating_s), tid
            assert turn.tool_call is not None and kept["tool_call"]["latency_s"] == \
                turn.tool_call.latency_s
    # The trajectories finished before the kill ran once and say so.
    assert all(r["resumed"] == [] for tid, r in by_id.items() if tid not in journal)

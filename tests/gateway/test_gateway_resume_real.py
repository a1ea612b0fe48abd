"""Turn-level resume on a REAL vLLM (CPU build) with bubblewrap sandboxes: a service
running a math job of multi-turn episodes (the trained checkpoint calls the python
tool, which runs in bwrap) is killed with SIGKILL once trajectories have journaled
turns, and started again on the same store and the same engine. Every trajectory is
delivered once; each that had journaled turns resumes from its last one, and its
record up to there is the journal's token for token (ids, logprobs, versions, mask),
its python calls run again in a fresh sandbox to rebuild it. The vLLM server is the
session's (`served`, shared with the gateway tests on real vLLM); the service here is
a `treadle serve` process of its own, to be killed."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.gateway_real import Served
from service.service_helpers import until
from treadle.agent.journal import JournaledTurn
from treadle.bench.faults import ServiceProcess
from treadle.envs.registry import get_suite
from treadle.store import NotFound, Store
from treadle.train.transcripts import heldout_tasks

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]
TOKEN = "resume-real"
AUTH = {"authorization": f"Bearer {TOKEN}"}
TASKS, SAMPLES = 8, 4


def _journal(db: Path) -> dict[str, list[JournaledTurn]]:
    with Store(db) as store:
        try:
            ids = [s.trajectory_id for s in store.unfinished("m")]
        except NotFound:
            return {}
        return {tid: [JournaledTurn.decode(b) for b in store.journaled("m", tid).turns]
                for tid in ids}


def _over(service: ServiceProcess) -> str | None:
    """Why no more turns will be journaled (the job ended), if so."""
    with Store(service.db) as store, contextlib.suppress(NotFound):
        if store.job("m").status.terminal:
            return "the job ended before three turns were journaled"
    return None


def test_a_kill_9_of_a_real_vllm_job_resumes_each_trajectory_from_its_last_turn(
        tmp_path: Path, trained_checkpoint: Path, served: Served) -> None:
    suite = get_suite("math")
    records = [suite.task_to_record(t) for t in heldout_tasks(TASKS)]
    service = ServiceProcess(tmp_path / "s.db", tmp_path / "s.log", TOKEN, [
        "--engine", served.vllm.url, "--served-model", served.vllm.model,
        "--tokenizer", str(trained_checkpoint), "--sandbox", "bwrap", "--policy", "verl"])
    service.start()
    try:
        r = httpx.post(f"{service.url}/v1/jobs", headers=AUTH, timeout=30, json={
            "job_id": "m", "tasks": {"suite": "math", "tasks": records},
            "samples_per_task": SAMPLES, "sampling": {"temperature": 1.0, "seed": 7},
            "limits": {"max_turns": 4, "max_total_tokens": 1024}})
        assert r.status_code == 201, r.text
        until(lambda: sum(len(t) for t in _journal(service.db).values()) >= 3,
              lambda: _over(service), service.db, service.proc)
    finally:
        service.kill()
    journal = {tid: turns for tid, turns in _journal(service.db).items() if turns}
    service.start()
    try:
        with httpx.stream("GET", f"{service.url}/v1/jobs/m/trajectories", headers=AUTH,
                          params={"follow": "true"}, timeout=600) as stream:
            got: list[dict[str, Any]] = [json.loads(line)["trajectory"]
                                         for line in stream.iter_lines() if line]
    finally:
        service.stop()
    assert len(got) == TASKS * SAMPLES
    assert len({t["trajectory_id"] for t in got}) == TASKS * SAMPLES
    assert not [t for t in got if t["status"] == "error"], "an infrastructure failure"
    by_id = {t["trajectory_id"]: t for t in got}
    assert journal, "nothing was journaled before the kill"
    for tid, turns in journal.items():
        record = by_id[tid]
        [point] = record["resumed"]
        assert (record["attempt"], point["turn"], point["discarded_turns"]) == (
            1, len(turns), 0), tid
        assert point["rerun_calls"] == sum(1 for t in turns for c in t.calls
                                           if c.name == "python")
        # The record's sampled tokens begin with the journal's replies, exactly.
        sampled = [(i, lp, v) for s in record["segments"] for i, m, lp, v in zip(
            s["response_ids"], s["loss_mask"], s["logprobs"], s["policy_versions"],
            strict=True) if m]
        kept = [(i, lp, v) for t in turns for i, lp, v in zip(
            t.output.output_ids, t.output.logprobs, t.output.policy_versions, strict=True)]
        assert sampled[:len(kept)] == kept, tid
        assert [t["output_tokens"] for t in record["turns"][:len(turns)]] == \
            [len(t.output.output_ids) for t in turns]
        assert [t["tool_call"]["name"] for t in record["turns"][:len(turns)]] == \
            [t.calls[0].name for t in turns]

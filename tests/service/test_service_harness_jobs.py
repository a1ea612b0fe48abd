"""Harness jobs: each trajectory is a session driven by a harness command through the
gateway (the docs' example harness, `treadle.examples.math_harness`), on a scripted
engine (`FakeVLLMServer`); scored by the suite's verifier; crashes are
infrastructure failures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.cli import main
from treadle.client import RolloutClient
from treadle.gateway.harness import Harness
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.store.export import read_parquet
from treadle.types import FailureStage, TrajectoryStatus

pytestmark = [pytest.mark.integration]
EXAMPLE = f"{sys.executable} -m treadle.examples.math_harness"
SUBMIT = '<tool_call>\n{"name": "submit_answer", "arguments": {"answer": "4"}}\n</tool_call>'


def _tasks(path: Path) -> Path:
    path.write_text(json.dumps({"id": "q1", "question": "What is 2 + 2?", "answer": "4"}) + "\n"
                    + json.dumps({"id": "q2", "question": "What is 2 + 3?", "answer": "5"})
                    + "\n")
    return path


def test_treadle_run_drives_the_example_harness_and_scores_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer(reply_ids=[*tok.encode(SUBMIT), tok.token_id("<|im_end|>")])
    with fake.serve() as engine:
        code = main(["run", str(_tasks(tmp_path / "t.jsonl")), "--suite", "math", "--group",
                     "2", "--engine", engine, "--served-model", "m", "--tokenizer",
                     str(tmp_path / "tok"), "--harness", EXAMPLE, "--sandbox", "local",
                     "--job-id", "h1", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.splitlines()[1].split()[:3] == ["completed", "4", "0.500"]
    back = [t for _, t in read_parquet(tmp_path / "h1.parquet")]
    assert sorted((t.task_id, t.reward) for t in back) == [
        ("q1", 1.0), ("q1", 1.0), ("q2", 0.0), ("q2", 0.0)]
    prompts = [r["prompt"] for r in fake.requests]
    for t in back:
        (seg,) = t.segments
        assert len(t.turns) == 1 and seg.prompt_ids in prompts  # what the engine was sent
        assert seg.response_ids == fake.reply_ids and seg.loss_mask == [1] * len(seg.response_ids)
        # The harness saw the task's prompt and the suite's tools, never its answer.
        assert "What is 2 + " in tok.decode(seg.prompt_ids)
        assert '"answer": "4"' not in tok.decode(seg.prompt_ids).split("Problem:")[-1]


def test_a_crashing_harness_is_an_infrastructure_failure_and_names_are_checked(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    crash = Harness("crash", (sys.executable, "-c", "import sys; sys.stderr.write('no key');"
                                                    "sys.exit(3)"))
    fake = FakeVLLMServer()
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"), harnesses={"crash": crash})
        with running_service(config) as url:
            records = [json.loads(line) for line in _tasks(tmp_path / "t.jsonl").read_text(
                ).splitlines()]
            job = {"tasks": {"suite": "math", "tasks": records,
                             "options": {"python_tool": False}},
                   "samples_per_task": 2, "harness": {"name": "crash"}, "job_id": "c1"}
            assert httpx.post(f"{url}/v1/jobs", json=job).status_code == 201
            unknown = httpx.post(f"{url}/v1/jobs", json={**job, "job_id": "c2",
                                                         "harness": {"name": "nope"}})
            assert unknown.status_code == 422
            assert unknown.json()["detail"][0]["loc"] == ["body", "harness", "name"]
            with RolloutClient(url) as client:
                back = [d.trajectory for d in client.trajectories("c1")]
                view = client.job("c1")
    assert len(back) == 4
    for t in back:
        assert t.status is TrajectoryStatus.ERROR and t.failure_stage is FailureStage.HARNESS
        assert t.reward is None and t.reason is not None and "no key" in t.reason
    assert view.infrastructure_failures == 4
    assert fake.requests == []
    del tok


def test_a_continuous_job_of_a_harness_hands_out_its_groups_as_they_are_taken(
        tmp_path: Path) -> None:
    """A harness job may be continuous: treadle starts each run of the command, so its
    groups stream and are taken as a trainer needs them (and a stale one could be
    run again); every group taken once, each member a scored harness run."""
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer(reply_ids=[*tok.encode(SUBMIT), tok.token_id("<|im_end|>")])
    example = Harness("example", tuple(EXAMPLE.split()))
    records = [json.loads(line) for line in _tasks(tmp_path / "t.jsonl").read_text(
        ).splitlines()]
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"),
                               harnesses={"example": example})
        with running_service(config) as url, RolloutClient(url) as client:
            job = client.submit({"harness": {"name": "example"}, "samples_per_task": 2,
                                 "continuous": {"in_flight": 1, "budget": 3}},
                                tasks={"suite": "math", "tasks": records, "seed": 5,
                                       "options": {"python_tool": False}})
            taken = client.take(job.job_id, 3, timeout_s=180.0)
            assert client.take(job.job_id, 1, timeout_s=180.0) == []  # the budget's
            state = client.job(job.job_id)
    assert state.status == "completed" and state.groups_taken == 3
    assert [g.taken for g in taken] == [1, 2, 3] and all(g.complete for g in taken)
    members = [d.trajectory for g in taken for d in g.members]
    assert len({t.trajectory_id for t in members}) == 6
    # Two epochs of the two tasks, drawn in seeded order: q1's runs answer right.
    assert {t.task_id for t in members} == {"q1", "q2"}
    for t in members:
        assert t.status is TrajectoryStatus.COMPLETED and len(t.turns) == 1
        assert t.reward == (1.0 if t.task_id == "q1" else 0.0)
        assert t.segments[0].response_ids == fake.reply_ids

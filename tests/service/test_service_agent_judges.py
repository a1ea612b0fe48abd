"""An agentic judge on a swe job, end to end: the judge is treadle's agent loop on the
policy's engines (the judge class), in a real bwrap sandbox holding a copy of the
trajectory's work tree, where it runs the tests; its verdict is read from its final
answer. A judge whose answer holds no verdict leaves the dimension None with the
reason, the trajectory flagged and unscored, never 0. The engine is scripted (the
agent's and the judge's replies are token ids in order)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.agent.chat import Call, HermesFormat
from treadle.client import RolloutClient
from treadle.core.scheduler import JUDGE_RANK
from treadle.envs.registry import get_suite
from treadle.sandbox.bwrap import BwrapBackend
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import JudgementStatus, Trajectory, TrajectoryStatus

pytestmark = [pytest.mark.integration]
FMT = HermesFormat()
TEMPLATE = ("Here is a fix:\n$diff\nRun the repository's tests (python3 -m unittest) and "
            "rate the $dimension of the fix from $low to $high.")
LIMITS = {"max_turns": 3, "max_total_tokens": 32768, "max_tokens_per_turn": 4096}
AGENT = {"tools": ["bash", "read_file"], "max_turns": 3, "max_total_tokens": 65536,
         "max_tokens_per_turn": 4096}


def reply(text: str = "", **call: Any) -> str:
    calls = [Call.of(call.pop("name"), call)] if call else []
    return FMT.reply_text(text, calls)


def job(url: str, client: RolloutClient) -> Trajectory:
    created = httpx.post(f"{url}/v1/jobs", json={
        "tasks": {"suite": "swe", "count": 1, "seed": 0}, "samples_per_task": 1,
        "limits": LIMITS,
        "rubric": {"verified": [{"name": "tests", "weight": 0.5}],
                   "judged": [{"name": "fix", "weight": 0.5, "template": TEMPLATE,
                               "agent": AGENT}],
                   "judge": {"attempts": 1, "max_tokens": 4096}}})
    assert created.status_code == 201, created.text
    (traj,) = [d.trajectory for d in client.trajectories(created.json()["job_id"],
                                                         follow=True)]
    assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
    return traj


def test_an_agentic_judge_runs_the_tests_in_a_copy_of_the_work_tree(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    (task,) = get_suite("swe").tasks(1, seed=0)
    path = sorted(p for p in task.metadata["files"] if not p.startswith("tests/"))[0]
    before = task.metadata["files"][path]
    check = f"python3 -m unittest 2>&1 | tail -n 1; grep -c 'patched by the agent' {path}"
    script = [
        # Job 1: the agent edits, the judge runs the tests where the edit is, answers.
        reply(name="write_file", path=path, content=before + "# patched by the agent\n"),
        reply("done"),
        reply(name="bash", command=check),
        reply(name="submit_answer", answer='{"score": 2, "reason": "the tests fail"}'),
        # Job 2: another edit; the judge answers without a verdict.
        reply(name="write_file", path=path, content=before + "# patched again\n"),
        reply("done"),
        reply("I cannot tell."),
    ]
    fake = FakeVLLMServer(script=[tok.encode(s) for s in script])
    # Under /tmp: the sandbox uid must be able to traverse every parent of its work dir.
    root = Path(tempfile.mkdtemp(prefix="treadle-judge-test-", dir="/tmp"))
    os.chmod(root, 0o711)
    with contextlib.ExitStack() as cleanup, fake.serve() as engine:
        cleanup.callback(shutil.rmtree, root, True)
        config = ServiceConfig(db=str(tmp_path / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"),
                               sandbox=BwrapBackend(work_root=str(root)))
        with running_service(config) as url, RolloutClient(url) as client:
            judged = job(url, client)
            unjudged = job(url, client)
    (j,) = judged.judgements
    assert j.status is JudgementStatus.JUDGED, j.reason
    assert (j.score, j.value, j.reason) == (2, 0.25, "the tests fail")
    assert j.prompt.startswith(f"Here is a fix:\n--- a/{path}\n+++ b/{path}\n")
    # What the judge's bash saw: the tests failing in its sandbox, and the agent's edit
    # there (one line), in the episode it kept.
    assert "FAILED (" in j.reply and "\n1\n" in j.reply, j.reply
    assert judged.rewards == {"tests": 0.0, "fix": 0.25}
    # The judge's two turns went to the engine as the judge class.
    mine = f"{judged.trajectory_id}/judge/fix/"
    judge_calls = [(r, ids) for r, ids in zip(fake.requests, fake.replies, strict=True)
                   if str(r.get("request_id")).startswith(mine)]
    assert len(judge_calls) == 2
    assert all(r["priority"] == min(2**31 - 1, round(JUDGE_RANK)) for r, _ in judge_calls)
    assert j.reply_ids == [i for _, ids in judge_calls for i in ids]
    # No verdict: None with the reason, flagged, unscored.
    (u,) = unjudged.judgements
    assert u.status is JudgementStatus.FAILED and u.value is None, u
    assert "VerdictError" in u.reason and "no JSON object with a score" in u.reason
    assert "I cannot tell." in u.reply  # the judge's episode, kept for audit
    assert unjudged.reward is None and unjudged.flagged
    assert unjudged.rewards == {"tests": 0.0, "fix": None}

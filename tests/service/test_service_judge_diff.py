"""A judged swe job shows its judge the change the agent made: the attempt reads the
work tree before its sandbox closes, and the judge's prompt holds the diff against the
task's files. On a scripted engine over HTTP (the agent's replies and the judge's
verdict are scripted token ids) and real sandboxes (the local backend)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.agent.chat import IM_END, Call, HermesFormat
from treadle.client import RolloutClient
from treadle.envs.registry import get_suite
from treadle.envs.suites.swe import unified_diff
from treadle.sandbox.local import LocalBackend
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import JudgementStatus, TrajectoryStatus

pytestmark = [pytest.mark.integration]
FMT = HermesFormat()
TEMPLATE = "Issue fixed?\n$diff\nRate the $dimension from $low to $high as JSON."


def test_a_judged_swe_trajectory_shows_its_judge_the_agents_edit(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    (task,) = get_suite("swe").tasks(1, seed=0)
    path = sorted(p for p in task.metadata["files"] if not p.startswith("tests/"))[0]
    before = task.metadata["files"][path]
    after = before + "# patched by the agent\n"
    edit = FMT.reply_text("", [Call.of("write_file", {"path": path, "content": after})])
    script = [tok.encode(edit), tok.encode(FMT.reply_text("done", [])),
              tok.encode('{"score": 4, "reason": "a small edit"}' + IM_END)]
    fake = FakeVLLMServer(script=script)
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"), sandbox=LocalBackend())
        with running_service(config) as url, RolloutClient(url) as client:
            created = httpx.post(f"{url}/v1/jobs", json={
                "tasks": {"suite": "swe", "count": 1, "seed": 0}, "samples_per_task": 1,
                "limits": {"max_turns": 3, "max_total_tokens": 32768,
                           "max_tokens_per_turn": 4096},
                "rubric": {"verified": [{"name": "tests", "weight": 0.5}],
                           "judged": [{"name": "quality", "weight": 0.5,
                                       "template": TEMPLATE}],
                           "judge": {"attempts": 1}}})
            assert created.status_code == 201, created.text
            job = created.json()["job_id"]
            (traj,) = [d.trajectory for d in client.trajectories(job, follow=True)]
    assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
    (j,) = traj.judgements
    assert j.status is JudgementStatus.JUDGED, j.reason
    # The judge saw exactly the agent's edit, and nothing of the grader's scratch.
    assert j.prompt == ("Issue fixed?\n" + unified_diff(path, before, after)
                        + "\nRate the quality from 1 to 5 as JSON.")
    assert "+# patched by the agent" in j.prompt
    # The bug is still there: the tests fail, the judge's verdict stands beside them.
    assert traj.rewards == {"tests": 0.0, "quality": 0.75}

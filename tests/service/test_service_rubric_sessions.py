"""Rubrics on harness jobs and on sessions jobs: a harness run, once its verifier has
scored it, and a session its owner ended with a reward are judged on the job's rubric
before they are delivered; the owner's end answers with the rubric's reward. On a
scripted engine (the harness's or the session's reply, then the judge's verdict)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.agent.tokenizer import HFTokenizer
from treadle.client import RolloutClient
from treadle.gateway.harness import Harness
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import JudgementStatus, RewardSource, Trajectory, TrajectoryStatus

pytestmark = [pytest.mark.integration]
TOKEN = "rubric-token"
TEMPLATE = "Task: $task\nAnswer: $answer\nRate the $dimension from $low to $high as JSON."
VERDICT = '{"score": 4, "reason": "clear"}'
MATH = Harness("math", (sys.executable, "-m", "treadle.examples.math_harness"))


class Service:
    def __init__(self, url: str, fake: FakeVLLMServer, tok: HFTokenizer) -> None:
        self.url, self.fake, self.tok = url, fake, tok
        self.http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"},
                                 timeout=60)

    def script(self, *replies: str) -> None:
        im_end = self.tok.token_id("<|im_end|>")
        self.fake.script.extend([*self.tok.encode(r), im_end] for r in replies)

    def job(self, body: dict[str, object]) -> str:
        created = self.http.post("/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        job_id: str = created.json()["job_id"]
        return job_id

    def trajectories(self, job_id: str) -> list[Trajectory]:
        with RolloutClient(self.url, token=TOKEN) as client:
            return [d.trajectory for d in client.trajectories(job_id, follow=True)]


def rubric(verified: str) -> dict[str, object]:
    return {"verified": [{"name": verified, "weight": 0.5}],
            "judged": [{"name": "clarity", "weight": 0.5, "template": TEMPLATE}],
            "judge": {"attempts": 1}}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("rubric-sessions")
    tok = build_tokenizer(tmp / "tok")
    fake = FakeVLLMServer()
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp / "s.db"), token=TOKEN, policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp / "tok"), harnesses={"math": MATH})
        with running_service(config) as url:
            s = Service(url, fake, tok)
            yield s
            s.http.close()


def test_a_harness_run_is_judged_after_its_verifier(service: Service) -> None:
    service.script("4", VERDICT)  # the harness's one call, then the judge's
    job = service.job({"tasks": {"suite": "math", "options": {"python_tool": False},
                                 "tasks": [{"id": "q1", "question": "What is 2 + 2?",
                                            "answer": "4"}]},
                       "samples_per_task": 1, "harness": {"name": "math"},
                       "rubric": rubric("correct")})
    (traj,) = service.trajectories(job)
    assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
    (j,) = traj.judgements
    assert j.status is JudgementStatus.JUDGED, j.reason
    assert j.prompt.startswith("Task: ") and "What is 2 + 2?" in j.prompt
    assert j.prompt.endswith("\nAnswer: 4\nRate the clarity from 1 to 5 as JSON.")
    assert traj.rewards == {"correct": 1.0, "clarity": 0.75}
    assert traj.reward == pytest.approx(0.875)
    assert traj.reward_source is RewardSource.RUBRIC


def test_a_session_its_owner_scores_is_judged_on_its_jobs_rubric(service: Service) -> None:
    job = service.job({"tasks": {"sessions": 1}, "samples_per_task": 2,
                       "rubric": rubric("owner")})
    ended = []
    for reward in (1.0, None):
        created = service.http.post("/v1/sessions", json={"job_id": job})
        assert created.status_code == 201, created.text
        info = created.json()
        client = openai.OpenAI(base_url=info["base_url"], api_key=TOKEN, max_retries=0)
        service.script("4", *([VERDICT] if reward is not None else []))
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is 2 + 2?"}])
        assert reply.choices[0].message.content == "4"
        end = service.http.post(f"/v1/sessions/{info['session_id']}/end",
                                json={"reward": reward})
        assert end.status_code == 200, end.text
        ended.append(end.json())
    # The owner's end answers with the rubric's reward: the judges were in before it.
    assert ended[0]["reward"] == pytest.approx(0.875)
    assert ended[1]["reward"] is None
    scored, unscored = sorted(service.trajectories(job), key=lambda t: t.key.repetition)
    (j,) = scored.judgements
    assert j.prompt == "Task: What is 2 + 2?\nAnswer: 4\nRate the clarity from 1 to 5 as JSON."
    assert scored.rewards == {"owner": 1.0, "clarity": 0.75}
    assert scored.reward_source is RewardSource.RUBRIC
    # Ended without a reward: nothing to add to, no judge asked.
    assert unscored.judgements == [] and unscored.reward is None
    assert not any("/judge/" in str(r.get("request_id")) and unscored.trajectory_id in
                   str(r.get("request_id")) for r in service.fake.requests)


def test_an_agentic_judge_on_a_service_without_sandboxes_is_refused(service: Service) -> None:
    agentic = {**rubric("owner"), "judged": [{"name": "clarity", "weight": 0.5,
                                              "template": TEMPLATE, "agent": {}}]}
    for tasks in ({"sessions": 1}, {"suite": "math", "count": 1}):
        refused = service.http.post("/v1/jobs", json={"tasks": tasks, "rubric": agentic})
        assert refused.status_code == 422, refused.text
        assert "an agentic judge works in a sandbox" in refused.text

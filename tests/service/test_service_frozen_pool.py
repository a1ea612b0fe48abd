"""Frozen sub-agents on a frozen engine pool: their calls reach only the frozen
engines, their tokens carry the pinned version whatever the policy's engines serve,
and a service without a frozen pool refuses a session that asks for one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.agent.tokenizer import HFTokenizer
from treadle.client import RolloutClient
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration]
TOKEN = "frozen-token"
PINNED = 7


class Pools:
    """A service on two scripted engines: the policy's and a frozen one."""

    def __init__(self, url: str, policy: FakeVLLMServer, frozen: FakeVLLMServer,
                 tok: HFTokenizer) -> None:
        self.url, self.policy, self.frozen, self.tok = url, policy, frozen, tok
        self.http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"},
                                 timeout=30)

    def reply(self, engine: FakeVLLMServer, text: str) -> None:
        engine.script.append([*self.tok.encode(text), self.tok.token_id("<|im_end|>")])

    def ask(self, base_url: str, question: str) -> str:
        client = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
        reply = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": question}])
        return reply.choices[0].message.content or ""


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[Pools]:
    tok = build_tokenizer(tmp_path / "tok")
    policy, frozen = FakeVLLMServer(), FakeVLLMServer()
    with policy.serve() as policy_url, frozen.serve() as frozen_url:
        config = ServiceConfig(
            db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
            engines=[EngineRequest(url=policy_url, model="m")],
            frozen_engines=[EngineRequest(url=frozen_url, model="m", pool="frozen")],
            frozen_policy_version=PINNED, tokenizer=str(tmp_path / "tok"))
        with running_service(config) as url:
            p = Pools(url, policy, frozen, tok)
            yield p
            p.http.close()


def test_frozen_sub_agents_run_on_the_frozen_pool_at_its_pinned_version(
        pools: Pools) -> None:
    engines = pools.http.get("/v1/engines").json()
    assert sorted((e["engine_id"], e["pool"]) for e in engines) == [
        ("e000", "policy"), ("f000", "frozen")]
    assert pools.http.get("/v1/weights").json()["frozen_policy_version"] == PINNED
    parent = pools.http.post("/v1/sessions", json={}).json()
    child = pools.http.post("/v1/sessions", json={
        "parent_session_id": parent["session_id"], "trainable": False}).json()
    # The policy's engines move on to version 3; the frozen pool stays where it is.
    assert pools.http.post("/v1/weights/pause", json={}).status_code == 200
    assert pools.http.post("/v1/weights/resume", json={"policy_version": 3}).status_code == 200
    pools.reply(pools.frozen, "found it")
    assert pools.ask(child["base_url"], "search for it") == "found it"
    pools.reply(pools.policy, "done")
    assert pools.ask(parent["base_url"], "what did it find?") == "done"
    assert len(pools.frozen.requests) == 1 and len(pools.policy.requests) == 1
    view = pools.http.get(f"/v1/sessions/{child['session_id']}").json()
    assert view["engine_pool"] == "frozen"
    for session in (child, parent):
        assert pools.http.post(f"/v1/sessions/{session['session_id']}/end",
                               json={"reward": 1.0}).status_code == 200
    with RolloutClient(pools.url, token=TOKEN) as client:
        trajs = {d.trajectory.trajectory_id: d.trajectory
                 for d in client.trajectories(parent["job_id"])}
    frozen, orchestrator = trajs[child["trajectory_id"]], trajs[parent["trajectory_id"]]
    assert not frozen.trainable and frozen.parent_id == orchestrator.trajectory_id
    assert {v for s in frozen.segments for v in s.policy_versions} == {PINNED}
    assert {t.policy_version for t in frozen.turns} == {PINNED}
    assert {t.policy_version for t in orchestrator.turns} == {3}
    assert frozen.segments[0].response_ids == pools.frozen.replies[0]


def test_a_session_may_choose_its_pool_within_what_the_service_has(
        pools: Pools, tmp_path: Path) -> None:
    # Frozen tokens are off-policy: a trainable session cannot ask for them.
    refused = pools.http.post("/v1/sessions", json={"engine_pool": "frozen"})
    assert refused.status_code == 422 and "trainable" in refused.text
    # A frozen sub-agent may still be served by the policy's engines, if it asks.
    parent = pools.http.post("/v1/sessions", json={}).json()
    child = pools.http.post("/v1/sessions", json={
        "parent_session_id": parent["session_id"], "trainable": False,
        "engine_pool": "policy"}).json()
    assert pools.http.get(f"/v1/sessions/{child['session_id']}").json()[
        "engine_pool"] == "policy"
    pools.reply(pools.policy, "from the policy")
    assert pools.ask(child["base_url"], "hi") == "from the policy"
    assert not pools.frozen.requests


def test_without_a_frozen_pool_a_session_asking_for_one_is_refused(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "tok")
    engine = FakeVLLMServer()
    with engine.serve() as engine_url:
        config = ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                               engines=[EngineRequest(url=engine_url, model="m")],
                               tokenizer=str(tmp_path / "tok"))
        with running_service(config) as url, httpx.Client(
                base_url=url, headers={"authorization": f"Bearer {TOKEN}"}) as http:
            assert http.get("/v1/weights").json()["frozen_policy_version"] is None
            refused = http.post("/v1/sessions", json={"trainable": False,
                                                      "engine_pool": "frozen"})
            assert refused.status_code == 422 and "no frozen engines" in refused.text
            # Not trainable, no frozen pool: the policy's engines serve it.
            made = http.post("/v1/sessions", json={"trainable": False}).json()
            assert http.get(f"/v1/sessions/{made['session_id']}").json()[
                "engine_pool"] == "policy"

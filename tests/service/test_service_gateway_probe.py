"""What a probe with real harnesses found the gateway doing wrong, each held here over
HTTP with the real `openai` client: a session's limits past its engine's context, a
reply cut by the context said `tool_calls`, a session the gateway ended could not
be scored by its owner, a session with no call was stored a completed trajectory
(and failed the converters' batch); and structured output (response_format) reaching
the engine as the call's constraint, recorded on its turn, refused where it cannot
be served, naming it in full."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from service_helpers import running_service
from test_service_gateway import CALL, TOOLS

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.agent.tokenizer import HFTokenizer
from treadle.client import RolloutClient
from treadle.client.samples import training_sequences
from treadle.core.cost_model import CostModel
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_server import serve_in_thread
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import FailureStage, JsonSchemaConstraint, Trajectory, TrajectoryStatus

pytestmark = [pytest.mark.integration]
TOKEN = "probe-token"
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}


class Served:
    def __init__(self, url: str, tok: HFTokenizer, fake: FakeVLLMServer | None) -> None:
        self.url, self.tok, self.fake = url, tok, fake
        self.http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"},
                                 timeout=60)

    def session(self, **body: Any) -> tuple[dict[str, Any], openai.OpenAI]:
        created = self.http.post("/v1/sessions", json=body)
        assert created.status_code == 201, created.text
        info = created.json()
        return info, openai.OpenAI(base_url=info["base_url"], api_key=TOKEN, max_retries=0)

    def reply(self, text: str) -> None:
        assert self.fake is not None
        self.fake.script.append([*self.tok.encode(text), self.tok.token_id("<|im_end|>")])

    def end(self, info: dict[str, Any], **body: Any) -> httpx.Response:
        return self.http.post(f"/v1/sessions/{info['session_id']}/end", json=body)

    def trajectory(self, info: dict[str, Any]) -> Trajectory:
        with RolloutClient(self.url, token=TOKEN) as client:
            (delivered,) = list(client.trajectories(info["job_id"]))
        return delivered.trajectory


def _config(tmp_path: Path, engine: str, kind: str = "vllm") -> ServiceConfig:
    return ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                         engines=[EngineRequest(url=engine, model="m", kind=kind)],  # type: ignore[arg-type]
                         tokenizer=str(tmp_path / "tok"))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer()
    with fake.serve() as engine, running_service(_config(tmp_path, engine)) as url:
        s = Served(url, tok, fake)
        yield s
        s.http.close()


@pytest.fixture
def small_engine(tmp_path: Path) -> Iterator[Served]:
    """The service on an emulated engine whose context is 300 tokens."""
    tok = build_tokenizer(tmp_path / "tok")
    engine = EmulatedEngine(CostModel.named("qwen3-8b", "h100"), time_scale=0.01, seed=1,
                            max_model_len=300)
    with serve_in_thread(engine, "m") as srv, \
            running_service(_config(tmp_path, srv.url, "emulated")) as url:
        s = Served(url, tok, None)
        yield s
        s.http.close()


def test_session_limits_come_from_the_engines_context(small_engine: Served) -> None:
    info, client = small_engine.session()
    assert info["max_total_tokens"] == 300  # not 4096: the engine serves 300
    long = [{"role": "user", "content": "count " * 40}]
    reply = client.chat.completions.create(model="policy", messages=long)
    # Cut at the room the context leaves (the default 1024 per turn would have been
    # the engine's own 400, and the session's end).
    assert reply.usage is not None and reply.usage.total_tokens <= 300
    assert reply.choices[0].finish_reason == "length"
    too_many = small_engine.http.post("/v1/sessions", json={"limits": {
        "max_total_tokens": 4096}})
    assert too_many.status_code == 422, too_many.text
    (entry,) = too_many.json()["detail"]
    assert entry["loc"] == ["body", "limits", "max_total_tokens"]
    assert "300" in entry["msg"]
    assert small_engine.end(info, reward=0.0).status_code == 200


def test_a_reply_cut_by_its_budget_says_length_though_it_holds_a_call(served: Served) -> None:
    _, client = served.session(limits={"max_total_tokens": 4096})
    served.reply(CALL + " and then a long explanation of what it will print")
    n = len(served.tok.encode(CALL)) + 2  # the call fits, the rest does not
    reply = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS,
                                           max_tokens=n)
    assert reply.choices[0].message.tool_calls  # parsed as the model wrote it...
    assert reply.choices[0].finish_reason == "length"  # ...but the engine cut it


def test_a_session_the_gateway_ended_can_still_be_scored_by_its_owner(served: Served) -> None:
    info, client = served.session()
    served.reply("thinking")
    client.chat.completions.create(model="policy", messages=USER)
    assert served.fake is not None
    served.fake.mode = "reject400"  # the engine refuses the next context: truncated
    messages: list[Any] = [*USER, {"role": "assistant", "content": "thinking"},
                           {"role": "user", "content": "go on"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="policy", messages=messages)
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ended:  # ended: not a 404
        client.chat.completions.create(model="policy", messages=messages)
    assert ended.value.code == "session_ended"
    scored = served.end(info, reward=1.0, status="completed")
    assert scored.status_code == 200, scored.text  # was a 404: the reward was lost
    assert scored.json()["status"] == "truncated"  # what ended it stands
    traj = served.trajectory(info)
    assert (traj.status, traj.reward, len(traj.turns)) == (TrajectoryStatus.TRUNCATED, 1.0, 1)


def test_a_session_without_a_served_call_is_no_completed_trajectory(served: Served) -> None:
    info, client = served.session()
    with pytest.raises(openai.BadRequestError):  # its only call is refused
        client.chat.completions.create(model="policy", messages=USER, n=2)
    assert served.end(info, reward=1.0).status_code == 200
    traj = served.trajectory(info)
    assert (traj.status, traj.failure_stage, traj.reward, traj.segments) == (
        TrajectoryStatus.ERROR, FailureStage.HARNESS, None, [])
    assert "no call was served" in (traj.reason or "")
    assert training_sequences([traj]).sequences == []  # excluded, no batch fails


def test_response_format_reaches_the_engine_and_the_turn(served: Served) -> None:
    info, client = served.session()
    served.reply('{"answer": 3}')
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    reply = client.chat.completions.create(model="policy", messages=USER, response_format=fmt)
    assert reply.choices[0].message.content == '{"answer": 3}'
    assert served.fake is not None
    assert served.fake.requests[-1]["structured_outputs"] == {"json": SCHEMA}
    # With tools the model may call, the whole reply could not be decoded under it.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="policy", messages=USER, tools=TOOLS,
                                       response_format=fmt)
    assert refused.value.param == "response_format"  # type: ignore[attr-defined]
    assert "json_schema with tools the model may call" in str(refused.value)
    assert served.end(info, reward=1.0).status_code == 200
    (turn,) = served.trajectory(info).turns
    assert turn.constraint == JsonSchemaConstraint(SCHEMA, "answer")


def test_response_format_on_engines_without_a_grammar_is_refused_in_full(
        small_engine: Served) -> None:
    info, client = small_engine.session()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="policy", messages=USER,
                                       response_format={"type": "json_object"})
    assert refused.value.param == "response_format"  # type: ignore[attr-defined]
    assert refused.value.body["message"] == (  # type: ignore[index]
        "response_format json_object is not served by this session's engines: the engine "
        "cannot decode under a json_object constraint (structured output it serves: none)")
    reply = client.chat.completions.create(model="policy", messages=USER, max_tokens=4)
    assert reply.choices  # the session goes on
    assert small_engine.end(info, reward=0.0).status_code == 200

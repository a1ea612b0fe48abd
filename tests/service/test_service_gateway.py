"""The harness gateway over HTTP, driven by the real `openai` client from PyPI, on a
scripted engine (`FakeVLLMServer`: exact replies in the tokenizer's vocabulary).
The same flows on real vLLM are in tests/gateway/test_gateway_vllm_real.py."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.agent.fingerprint import tokenizer_fingerprint
from treadle.agent.tokenizer import HFTokenizer
from treadle.client import RolloutClient
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import FailureStage, Trajectory, TrajectoryStatus

pytestmark = [pytest.mark.integration]
TOKEN = "gw-token"
TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "run a program",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1 + 2)"}}\n</tool_call>'


class Gateway:
    """A running service on a scripted engine, and clients for it."""

    def __init__(self, url: str, fake: FakeVLLMServer, tok: HFTokenizer) -> None:
        self.url, self.fake, self.tok = url, fake, tok
        self.http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"},
                                 timeout=30)
        self.im_end = tok.token_id("<|im_end|>")

    def reply(self, text: str) -> None:
        self.fake.script.append([*self.tok.encode(text), self.im_end])

    def session(self, **body: Any) -> tuple[dict[str, Any], openai.OpenAI]:
        created = self.http.post("/v1/sessions", json=body)
        assert created.status_code == 201, created.text
        info = created.json()
        return info, openai.OpenAI(base_url=info["base_url"], api_key=TOKEN, max_retries=0)

    def trajectories(self, job_id: str) -> list[Trajectory]:
        with RolloutClient(self.url, token=TOKEN) as client:
            return [d.trajectory for d in client.trajectories(job_id)]


def _config(tmp_path: Path, engine: str, **more: Any) -> ServiceConfig:
    """A service on the scripted engine at `engine`, with the tokenizer in tmp_path/tok."""
    return ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                         engines=[EngineRequest(url=engine, model="m")],
                         tokenizer=str(tmp_path / "tok"), **more)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer()
    with fake.serve() as engine:
        config = _config(tmp_path, engine)
        with running_service(config) as url:
            gw = Gateway(url, fake, tok)
            yield gw
            gw.http.close()


def test_a_multi_turn_tool_conversation_is_recorded_token_exact(gateway: Gateway) -> None:
    info, client = gateway.session(metadata={"harness": "test"})
    gateway.reply(CALL)
    gateway.reply("the answer is 3")
    messages: list[Any] = [{"role": "user", "content": "what is 1 + 2?"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                           logprobs=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "python"
    assert json.loads(call.function.arguments) == {"code": "print(1 + 2)"}
    assert choice.logprobs is not None and [t.logprob for t in choice.logprobs.content or []] \
        == pytest.approx([-0.1 * (i + 1) for i in range(len(gateway.fake.replies[0]))])
    assert first.usage is not None and first.usage.completion_tokens == len(
        gateway.fake.replies[0])
    # The harness echoes the reply as the SDK parsed it, and adds the tool's result.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    stream = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "the answer is 3"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
        gateway.fake.replies[1])
    ended = gateway.http.post(f"/v1/sessions/{info['session_id']}/end",
                              json={"reward": 1.0, "rewards": {"exact_match": 1}})
    assert ended.status_code == 200, ended.text
    assert ended.json()["status"] == "completed" and ended.json()["turns"] == 2
    (traj,) = gateway.trajectories(info["job_id"])
    assert traj.status is TrajectoryStatus.COMPLETED and traj.reward == 1.0
    assert traj.metrics == {"exact_match": 1.0} and traj.metadata == {"harness": "test"}
    (seg,) = traj.segments
    sent = [r["prompt"] for r in gateway.fake.requests]
    assert sent[0] == seg.prompt_ids
    r1, r2 = gateway.fake.replies
    observation = sent[1][len(sent[0]) + len(r1):]
    assert sent[1] == seg.prompt_ids + r1 + observation  # the sampled ids, not re-encoded
    assert gateway.tok.decode(observation) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert seg.response_ids == r1 + observation + r2
    assert seg.loss_mask == [1] * len(r1) + [0] * len(observation) + [1] * len(r2)
    assert seg.logprobs == [-0.1 * (i + 1) for i in range(len(r1))] + [0.0] * len(
        observation) + [-0.1 * (i + 1) for i in range(len(r2))]  # both replies', exactly
    assert [t.tool_call.name if t.tool_call else None for t in traj.turns] == ["python", None]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) spans of the mask's runs of 1 (the model's replies)."""
    edges = [0, *mask, 0]
    starts = [i for i in range(len(mask)) if edges[i + 1] and not edges[i]]
    ends = [i for i in range(1, len(mask) + 1) if edges[i] and not edges[i + 1]]
    return list(zip(starts, ends, strict=True))


def test_what_the_gateway_cannot_honour_is_a_400_naming_the_parameter(
        gateway: Gateway) -> None:
    info, client = gateway.session()
    messages = [{"role": "user", "content": "hi"}]
    for extra, param in [({"n": 2}, "n"), ({"top_logprobs": 3}, "top_logprobs"),
                         ({"extra_body": {"guided_json": {}}}, "guided_json"),
                         ({"messages": [{"role": "function", "content": "x"}]},
                          "messages[0].role"),
                         ({"max_completion_tokens": 8, "max_tokens": True}, "max_tokens")]:
        kwargs: dict[str, Any] = {"model": "policy", "messages": messages, **extra}
        if "extra_body" in kwargs:
            kwargs.update(kwargs.pop("extra_body"))
            with pytest.raises(TypeError):  # the SDK itself refuses unknown keywords
                client.chat.completions.create(**kwargs)
            kwargs = {"model": "policy", "messages": messages, "extra_body": extra["extra_body"]}
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**kwargs)
        assert bad.value.body is not None and bad.value.body["param"] == param  # type: ignore[index]
    missing = openai.OpenAI(base_url=info["base_url"].replace(info["session_id"], "nope"),
                            api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        missing.chat.completions.create(model="policy", messages=messages)
    assert client.models.list().data[0].id == "policy"
    wrong = openai.OpenAI(base_url=info["base_url"], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="policy", messages=messages)
    assert gateway.fake.requests == []  # nothing refused reached the engine


def test_a_session_at_its_turn_limit_says_which_limit(gateway: Gateway) -> None:
    info, client = gateway.session(limits={"max_turns": 1, "max_total_tokens": 4096})
    gateway.reply("one")
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "again"}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="policy", messages=messages)
    assert bad.value.body["param"] == "max_turns"  # type: ignore[index]
    view = gateway.http.get(f"/v1/sessions/{info['session_id']}").json()
    assert view["status"] == "running" and view["turns"] == 1  # open for its owner to end
    gateway.http.post(f"/v1/sessions/{info['session_id']}/end", json={"reward": 0.0})
    assert gateway.http.get(f"/v1/sessions/{info['session_id']}").status_code == 404


def test_a_sessions_job_is_taken_group_by_group_and_streamed(gateway: Gateway) -> None:
    job = gateway.http.post("/v1/jobs", json={"tasks": {"sessions": ["q1", "q2"]},
                                              "samples_per_task": 2, "job_id": "h1"})
    assert job.status_code == 201 and job.json()["planned"] == 4
    taken = []
    for group in ["q1", "q1", "q2", None]:
        body = {"job_id": "h1", **({"group_id": group} if group else {})}
        info, client = gateway.session(**body)
        taken.append(info["trajectory_id"])
        gateway.reply("done")
        client.chat.completions.create(model="policy",
                                       messages=[{"role": "user", "content": "go"}])
        gateway.http.post(f"/v1/sessions/{info['session_id']}/end", json={"reward": 0.5})
    assert taken == ["h1/q1/0", "h1/q1/1", "h1/q2/0", "h1/q2/1"]
    full = gateway.http.post("/v1/sessions", json={"job_id": "h1"})
    assert full.status_code == 409
    trajectories = gateway.trajectories("h1")
    assert sorted((t.key.group_id, t.key.repetition) for t in trajectories) == [
        ("h1/q1", 0), ("h1/q1", 1), ("h1/q2", 0), ("h1/q2", 1)]
    assert gateway.http.get("/v1/jobs/h1").json()["status"] == "completed"


def test_stop_strings_and_one_call_replies_are_cut_where_the_model_stops(
        gateway: Gateway) -> None:
    info, client = gateway.session()
    gateway.reply("first line\nSTOP and more")
    two = f"{CALL}\n{CALL.replace('1 + 2', '3')}"
    gateway.reply(two)
    messages: list[Any] = [{"role": "user", "content": "go"}]
    cut = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                         stop=["STOP"])
    assert cut.choices[0].message.content == "first line"
    assert cut.choices[0].finish_reason == "stop"
    messages += [cut.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "now a tool"}]
    one = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                         parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls or []) == 1
    gateway.http.post(f"/v1/sessions/{info['session_id']}/end", json={"reward": 0.0})
    (traj,) = gateway.trajectories(info["job_id"])
    assert [s.start_reason for s in traj.segments] == ["start"]
    (seg,) = traj.segments  # the echoed cut reply extended the context: one segment
    kept = [m for m, r in zip(seg.loss_mask, seg.response_ids, strict=True) if m]
    # Only what the model "said" before stopping is in the record, both times.
    assert gateway.tok.decode([r for m, r in zip(seg.loss_mask, seg.response_ids,
                                                 strict=True) if m]).count("</tool_call>") == 1
    assert "and more" not in gateway.tok.decode(seg.response_ids)
    # Each reply's sampled run is a strict prefix of what the engine returned, with
    # the engine's logprobs: cut, never re-encoded.
    runs = _runs(seg.loss_mask)
    assert len(runs) == 2 and sum(j - i for i, j in runs) == len(kept)
    for (i, j), reply in zip(runs, gateway.fake.replies, strict=True):
        assert 0 < j - i < len(reply) and seg.response_ids[i:j] == reply[:j - i], (i, j)
        assert seg.logprobs[i:j] == [-0.1 * (k + 1) for k in range(j - i)], (i, j)


def test_a_second_call_while_one_runs_is_409_and_an_engine_failure_is_503(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer()
    fake.mode = "hang"  # the first call waits inside the engine until it times out
    with fake.serve() as engine:
        config = _config(tmp_path, engine, request_timeout_s=1.0, engine_wait_s=1.0)
        with running_service(config) as url:
            gw = Gateway(url, fake, tok)
            info, client = gw.session()
            messages = [{"role": "user", "content": "hi"}]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(client.chat.completions.create, model="policy",
                                    messages=messages)
                # The first call is inside the engine (a minute bounds a hang).
                assert fake.received.wait(60), f"no call reached the engine: {first}"
                with pytest.raises(openai.ConflictError):  # another request: 409
                    client.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "other"}])
                # The same request again (a client's retry) gets the running call's
                # answer: here its engine failure.
                with pytest.raises(openai.InternalServerError) as retried:
                    client.chat.completions.create(model="policy", messages=messages)
                with pytest.raises(openai.InternalServerError) as failed:
                    first.result()
            assert failed.value.status_code == retried.value.status_code == 503
            # Ended by the gateway, it waits for its owner (who may still score it).
            assert len(fake.requests) >= 1 and gw.http.get(
                f"/v1/sessions/{info['session_id']}").json()["status"] == "error"
            assert gw.http.post(f"/v1/sessions/{info['session_id']}/end",
                                json={}).status_code == 200
            (traj,) = gw.trajectories(info["job_id"])
            gw.http.close()
    assert traj.status is TrajectoryStatus.ERROR and traj.failure_stage is FailureStage.ENGINE


def test_cancelling_a_job_cuts_its_sessions_call_and_the_service_goes_on(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer()
    fake.mode = "hang"
    with fake.serve() as engine:
        config = _config(tmp_path, engine)
        with running_service(config) as url:
            gw = Gateway(url, fake, tok)
            info, client = gw.session()
            messages = [{"role": "user", "content": "hi"}]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(client.chat.completions.create, model="policy",
                                    messages=messages)
                assert fake.received.wait(60), f"no call reached the engine: {first}"
                cancelled = gw.http.post(f"/v1/jobs/{info['job_id']}/cancel")
                assert cancelled.status_code == 200, cancelled.text
                with pytest.raises(openai.APIError):
                    first.result()
            (traj,) = gw.trajectories(info["job_id"])
            assert traj.status is TrajectoryStatus.ABORTED
            assert gw.http.get(f"/v1/sessions/{info['session_id']}").status_code == 404
            # The scheduler forgot the cut trajectory cleanly: a new session runs.
            fake.mode = "ok"
            gw.reply("still here")
            _, client2 = gw.session()
            again = client2.chat.completions.create(model="policy", messages=messages)
            assert again.choices[0].message.content == "still here"
            gw.http.close()


def test_a_restart_reopens_the_open_sessions_and_keeps_the_untaken_ones(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer()
    with fake.serve() as engine:
        config = _config(tmp_path, engine)
        with running_service(config) as url:
            gw = Gateway(url, fake, tok)
            job = gw.http.post("/v1/jobs", json={"tasks": {"sessions": 1},
                                                 "samples_per_task": 2, "job_id": "r1"})
            assert job.status_code == 201, job.text
            info, client = gw.session(job_id="r1")
            gw.reply("before")
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="policy", messages=messages)
            gw.http.close()
        with running_service(config) as url:  # the same store, a new process's memory
            gw = Gateway(url, fake, tok)
            # The open session is open again, where it was; the untaken one is free.
            assert gw.http.get(f"/v1/sessions/{info['session_id']}").json()["turns"] == 1
            second, other = gw.session(job_id="r1")
            assert second["trajectory_id"] == "r1/0/1"
            gw.reply("after")
            # (This test's service comes back on another port; a deployment's on its own.)
            client = openai.OpenAI(base_url=f"{url}/v1/sessions/{info['session_id']}/openai/v1",
                                   api_key=TOKEN, max_retries=0)
            client.chat.completions.create(model="policy", messages=[
                *messages, {"role": "assistant", "content": "before"},
                {"role": "user", "content": "and?"}])
            gw.reply("served")  # a session with no call served would be no trajectory
            other.chat.completions.create(model="policy", messages=messages)
            for session in (info, second):
                gw.http.post(f"/v1/sessions/{session['session_id']}/end", json={"reward": 1.0})
            got = {t.trajectory_id: t for t in gw.trajectories("r1")}
            gw.http.close()
    first = got["r1/0/0"]
    assert (first.status, first.reward, first.attempt) == (TrajectoryStatus.COMPLETED, 1.0, 1)
    assert [p.turn for p in first.resumed] == [1] and len(first.turns) == 2
    assert len(fake.requests) == 3  # its first call was not sent again
    assert got["r1/0/1"].reward == 1.0


def test_sessions_jobs_and_health_name_the_served_tokenizer(gateway: Gateway) -> None:
    # A trainer tokenizing on its own side compares this with its tokenizer's.
    expected = tokenizer_fingerprint(gateway.tok)
    info, _ = gateway.session()
    assert info["tokenizer_fingerprint"] == expected
    view = gateway.http.get(f"/v1/sessions/{info['session_id']}").json()
    assert view["tokenizer_fingerprint"] == expected
    with RolloutClient(gateway.url, token=TOKEN) as client:
        assert client.job(info["job_id"]).tokenizer_fingerprint == expected
        assert client.health().tokenizer_fingerprint == expected

"""Suite tasks in runner actors (`treadle serve --ray --runners N`): each task's
sandbox, agent loop, tool calls and reward run in an actor's process, on a local
Ray cluster of this module's own, beside a scripted engine given by URL (its replies
in the test tokenizer's vocabulary) and a local sandbox backend; the scheduler and
the journal stay in the service. An actor killed mid-task has its trajectory run
again as a new attempt that resumes from its journaled turns, planned in the new
actor: no journaled turn is sampled again. With sandbox servers on the cluster (a
fleet), the actors' sandboxes are the fleet's. A gateway session's turns run in an
actor too, its conversation in the service."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import Response
from service_helpers import running, until

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.runtime.ray_launcher import RayCluster
from treadle.runtime.ray_runners import RunnerActors
from treadle.runtime.ray_sandboxes import SandboxServers
from treadle.sandbox.autoscale import Scaling
from treadle.sandbox.local import LocalBackend
from treadle.service.schemas import EngineRequest
from treadle.service.state import Service, ServiceConfig
from treadle.store import NotFound, Store

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "tasks-token"
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1 + 2)"}}\n</tool_call>'
LIMITS = {"max_turns": 2}  # each trajectory: a call, its result, a call, its result
RUNNERS = RunnerActors(2, num_cpus=0, resources=(("treadle_runner", 1.0),))


class _Engine:
    """The scripted engine: every reply is CALL; `hold(n)` holds the n-th completion
    from now until `free` is set (its caller may go away meanwhile)."""

    def __init__(self, tok_dir: Path) -> None:
        tok = build_tokenizer(tok_dir)
        self.fake = FakeVLLMServer(reply_ids=[*tok.encode(CALL), tok.token_id("<|im_end|>")])
        self.free = threading.Event()
        self.holding = threading.Event()  # a completion is held now
        self._seen = 0
        self._held: set[int] = set()

        async def hold(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
            if request.url.path == "/v1/completions":
                self._seen += 1
                if self._seen in self._held:
                    self.holding.set()
                    await asyncio.to_thread(self.free.wait)
                    if await request.is_disconnected():
                        return Response(status_code=499)
            return await call_next(request)

        self.fake.app.middleware("http")(hold)

    def hold(self, n: int) -> None:
        self._held.add(self._seen + n)


Served = tuple[str, Service, _Engine, Path, str]  # ..., the engine's URL


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A one-node cluster with room for two runner actors, and a service whose suite
    tasks run in them."""
    work = tmp_path_factory.mktemp("tasks")
    engine = _Engine(work / "tok")
    ray.init(address="local", num_cpus=2, resources={"treadle_runner": 4, "treadle_sandbox": 1},
             include_dashboard=False, log_to_driver=False)
    try:
        with engine.fake.serve() as url:
            config = ServiceConfig(
                db=str(work / "s.db"), token=TOKEN, policy="verl",
                engines=[EngineRequest(url=url, model="m")], tokenizer=str(work / "tok"),
                sandbox=LocalBackend(), ray=RayCluster(None),
                runners=RUNNERS)
            try:
                with running(config, startup_timeout_s=240) as (base, service):
                    yield base, service, engine, work / "s.db", url
            finally:
                engine.free.set()
    finally:
        ray.shutdown()


def _records(client: httpx.Client, job: str) -> list[dict[str, Any]]:
    with client.stream("GET", f"/v1/jobs/{job}/trajectories", params={"follow": "true"},
                       timeout=300) as r:
        assert r.status_code == 200
        return [json.loads(line)["trajectory"] for line in r.iter_lines() if line]


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, headers={"authorization": f"Bearer {TOKEN}"})


def test_suite_tasks_run_their_tools_in_runner_actors(served: Served) -> None:
    url, service, engine, _, _ = served
    runners = service.runners
    assert runners is not None and runners.runs_tasks
    asked = len(engine.fake.requests)
    with _client(url) as client:
        before = runners.ran()
        r = client.post("/v1/jobs", json={"tasks": {"suite": "math", "count": 3, "seed": 1},
                                          "samples_per_task": 2, "limits": LIMITS,
                                          "job_id": "t"})
        assert r.status_code == 201, r.text
        records = _records(client, "t")
        ran = {name: k - before.get(name, 0) for name, k in runners.ran().items()}
        pids = {pid for pid, _ in runners.where().values()}
    assert len(records) == 6 and len({t["trajectory_id"] for t in records}) == 6
    # Every task ran in an actor (processes other than the service's), both had some.
    assert sum(ran.values()) == 6 and all(ran.values()), ran
    assert len(pids) == 2 and os.getpid() not in pids
    for t in records:
        assert t["attempt"] == 0 and t["failure_stage"] is None, t["reason"]
        assert len(t["turns"]) == 2
        calls = [turn["tool_call"] for turn in t["turns"]]
        # The python tool ran in the actor's sandbox: its output is the record's.
        assert all(c["name"] == "python" and c["error"] is None for c in calls), calls
    # Token-exact: each record's prompt is one the engine was sent, and its second
    # turn's context that prompt, then the first reply as sampled.
    sent = [q["prompt"] for q in engine.fake.requests[asked:]]
    assert len(sent) == 12
    reply = engine.fake.reply_ids
    assert reply is not None
    for t in records:
        prompt = t["segments"][0]["prompt_ids"]
        assert prompt in sent
        assert [*prompt, *reply] in [p[:len(prompt) + len(reply)] for p in sent]


def test_a_runner_killed_mid_task_resumes_its_trajectory_from_the_journal(
        served: Served) -> None:
    url, service, engine, db, _ = served
    runners = service.runners
    assert runners is not None
    engine.hold(2)  # the trajectory's second reply: asked once its first turn is kept
    asked = len(engine.fake.requests)
    with _client(url) as client:
        r = client.post("/v1/jobs", json={"tasks": {"suite": "math", "count": 1, "seed": 2},
                                          "limits": LIMITS, "job_id": "k"})
        assert r.status_code == 201, r.text
        until(lambda: _journaled(db) >= 1, lambda: _ended(db), db)
        [victim] = [x for x in runners.runners if x.trajectories]  # the job's one
        ray.kill(victim.actor)
        [record] = _records(client, "k")
    assert runners.lost_runners[-1] == victim.name
    assert record["attempt"] == 1 and record["failure_stage"] is None, record["reason"]
    # The new attempt resumed after the journaled turn, planned in the new actor ...
    assert [(p["attempt"], p["turn"]) for p in record["resumed"]] == [(1, 1)]
    assert service.rollouts.metrics.resumes == {"turn": 1}  # and in the service's journal
    assert len(record["turns"]) == 2
    # ... so the engine answered twice: turn 0, and turn 1 of the new attempt (the
    # lost attempt's turn 1 is held); the journaled turn was not sampled again, and
    # the new attempt's context is the first's: the prompt, then the kept reply.
    sent = [q["prompt"] for q in engine.fake.requests[asked:]]
    assert len(sent) == 2, len(sent)
    reply = engine.fake.reply_ids
    assert reply is not None
    assert sent[1][:len(sent[0]) + len(reply)] == [*sent[0], *reply]
    assert record["segments"][0]["prompt_ids"] == sent[0]


def test_suite_tasks_in_runner_actors_run_their_tools_on_the_sandbox_fleet(
        served: Served, tmp_path: Path) -> None:
    _, _, _, _, engine_url = served
    config = ServiceConfig(
        db=str(tmp_path / "f.db"), token=TOKEN, policy="verl",
        engines=[EngineRequest(url=engine_url, model="m")], tokenizer=str(tmp_path / "tok"),
        sandbox_servers=SandboxServers(backend="local", max_live=8, num_cpus=0,
                                       resources=(("treadle_sandbox", 1.0),)),
        sandbox_scaling=Scaling(min_servers=1, max_servers=1), ray=RayCluster(None),
        runners=RUNNERS)
    build_tokenizer(tmp_path / "tok")  # the same tokenizer (trained the same way)
    with running(config, startup_timeout_s=240) as (url, service), _client(url) as client:
        runners, fleet = service.runners, service.fleet
        assert runners is not None and runners.runs_tasks and fleet is not None
        [server] = fleet.servers()
        r = client.post("/v1/jobs", json={"tasks": {"suite": "math", "count": 2, "seed": 5},
                                          "samples_per_task": 2, "limits": LIMITS,
                                          "job_id": "f"})
        assert r.status_code == 201, r.text
        records = _records(client, "f")
        ran = runners.ran()
        assert [s.url for s in fleet.servers()] == [server.url]
    # Every task ran in an actor, whose only sandboxes are its copy of the fleet's
    # backend: its tools ran on the fleet's server.
    assert len(records) == 4 and sum(ran.values()) == 4
    for t in records:
        assert t["failure_stage"] is None, t["reason"]
        calls = [turn["tool_call"] for turn in t["turns"]]
        assert len(calls) == 2 and all(c["error"] is None for c in calls), calls
        assert calls[0]["output_tokens"] > 0  # its result, shown to the model


def test_a_gateway_sessions_turns_run_in_a_runner_actor(served: Served) -> None:
    url, service, engine, _, _ = served
    runners = service.runners
    assert runners is not None
    asked = len(engine.fake.requests)
    with _client(url) as http:
        created = http.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        info = created.json()
        model = openai.OpenAI(base_url=info["base_url"], api_key=TOKEN, max_retries=0)
        reply = model.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "what is 1 + 2?"}])
        # Its runner is an actor's while it is open: the turn ran there.
        holders = [x.name for x in runners.runners if info["trajectory_id"] in x.trajectories]
        view = http.get(f"/v1/sessions/{info['session_id']}").json()
        ended = http.post(f"/v1/sessions/{info['session_id']}/end", json={"reward": 1.0})
    assert len(holders) == 1, holders
    assert view["turns"] == 1 and ended.status_code == 200, ended.text
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "python"  # the engine's scripted reply, parsed here
    assert len(engine.fake.requests) == asked + 1


def test_a_session_whose_runner_actor_is_lost_fails_its_call_and_ends_as_infrastructure(
        served: Served) -> None:
    url, service, engine, _, _ = served
    runners = service.runners
    assert runners is not None
    engine.holding.clear()
    engine.hold(1)
    with _client(url) as http:
        info = http.post("/v1/sessions", json={}).json()
        model = openai.OpenAI(base_url=info["base_url"], api_key=TOKEN, max_retries=0)
        failed: list[BaseException] = []

        def call() -> None:
            try:
                model.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "what is 1 + 2?"}])
            except Exception as e:
                failed.append(e)

        caller = threading.Thread(target=call)
        caller.start()
        engine.holding.wait()  # its turn is on the engine, called from the actor
        [victim] = [x for x in runners.runners if info["trajectory_id"] in x.trajectories]
        ray.kill(victim.actor)
        caller.join()
        view = http.get(f"/v1/sessions/{info['session_id']}")
    # The call fails as one the engines failed (503, retryable elsewhere), saying why,
    # and the session's trajectory ends as an error of the infrastructure.
    [error] = failed
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
    assert "its runner actor was lost" in str(error)
    assert view.status_code == 200 and view.json()["status"] == "error", view.text
    assert runners.lost_runners[-1] == victim.name


def _journaled(db: Path) -> int:
    """Turns journaled of job k's unfinished trajectory."""
    with Store(db) as store:
        try:
            return sum(len(store.journaled("k", s.trajectory_id).turns)
                       for s in store.unfinished("k"))
        except NotFound:  # (not submitted yet)
            return 0


def _ended(db: Path) -> str | None:
    with Store(db) as store:
        try:
            if store.job("k").status.terminal:
                return "the job ended before its first turn was journaled"
        except NotFound:
            pass
    return None

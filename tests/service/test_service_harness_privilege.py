"""A harness job holds only its session's key, and nothing a policy writes scores
itself: a harness of its own (`privilege_harness.py`) and the command its model
writes try every admin and trainer route, another session's `end` and their own,
with what their environment holds, and write the reward file; each is refused or
ignored, the reward comes from the source the job chose, and the record names it.
On a scripted engine (`FakeVLLMServer`); the sandboxed run uses real bubblewrap."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service, service_schema, until

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.gateway.harness import Harness
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration]
TOKEN = "privilege-admin"
SCRIPT = Path(__file__).with_name("privilege_harness.py")
TASK = {"id": "q1", "question": "What is 2 + 2?", "answer": "4"}
# What the model writes: a command that runs the harness script's probe.
COMMAND = '"$PROBE_PYTHON" "$PROBE_SCRIPT" probe'
TOOL_CALL = ("<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": COMMAND}})
             + "\n</tool_call>")
ANSWER = "The answer is 5."  # wrong: the verifier's reward is 0
OWN_REWARD = 0.25  # what the sandboxing harness reports (score reward_file)
COMMAND_REWARD = 0.75  # what the model-written command writes (privilege_harness.py)


def _bodies(ids: dict[str, str]) -> dict[str, tuple[str, Any]]:
    """Each route as the harness is told to try it: (path, body). Ids are the
    trainer's job, another session, a live engine, the trainer's key."""
    other, job = ids["other_session"], ids["job"]
    door = f"/v1/sessions/{other}/openai/v1"
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    return {
        "GET /metrics": ("/metrics", None), "GET /openapi.json": ("/openapi.json", None),
        "POST /v1/jobs": ("/v1/jobs", {"tasks": {"workload": "math", "trajectories": 16},
                                       "job_id": "made-by-harness"}),
        "GET /v1/jobs/{job_id}": (f"/v1/jobs/{job}", None),
        "POST /v1/jobs/{job_id}/metrics": (f"/v1/jobs/{job}/metrics",
                                           {"metrics": {"hacked": 1.0}}),
        "GET /v1/jobs/{job_id}/trajectories": (f"/v1/jobs/{job}/trajectories", None),
        "GET /v1/jobs": ("/v1/jobs", None),
        "GET /v1/jobs/{job_id}/timeline": (f"/v1/jobs/{job}/timeline", None),
        "GET /v1/jobs/{job_id}/groups": (f"/v1/jobs/{job}/groups", None),
        "GET /v1/jobs/{job_id}/record": (f"/v1/jobs/{job}/record?trajectory_id=t", None),
        "POST /v1/jobs/{job_id}/take": (f"/v1/jobs/{job}/take",
                                        {"take_id": "harness", "n": 1, "wait_s": 0.0}),
        "GET /v1/jobs/{job_id}/taken": (f"/v1/jobs/{job}/taken", None),
        "GET /v1/status": ("/v1/status", None),
        "POST /v1/jobs/{job_id}/cancel": (f"/v1/jobs/{job}/cancel", None),
        "POST /v1/rollouts": ("/v1/rollouts", {"suite": "math", "task": TASK,
                                               "options": {"python_tool": False}}),
        "POST /v1/sessions": ("/v1/sessions", {"parent_session_id": other}),
        "GET /v1/sessions/{session_id}": (f"/v1/sessions/{other}", None),
        "POST /v1/sessions/{session_id}/end": (f"/v1/sessions/{other}/end", {"reward": 1.0}),
        "POST /v1/sessions/{session_id}/openai/v1/chat/completions": (
            f"{door}/chat/completions", chat),
        "GET /v1/sessions/{session_id}/openai/v1/models": (f"{door}/models", None),
        "GET /v1/sessions/{session_id}/tools": (f"/v1/sessions/{other}/tools", None),
        "POST /v1/sessions/{session_id}/tools/{name}": (f"/v1/sessions/{other}/tools/bash",
                                                        {"command": "id"}),
        "GET /v1/engines": ("/v1/engines", None),
        "POST /v1/engines": ("/v1/engines", {"url": ids["engine_url"], "model": "m"}),
        "POST /v1/engines/{engine_id}/drain": (f"/v1/engines/{ids['engine']}/drain", None),
        "DELETE /v1/engines/{engine_id}": (f"/v1/engines/{ids['engine']}", None),
        "GET /v1/weights": ("/v1/weights", None),
        "POST /v1/weights/pause": ("/v1/weights/pause", {"mode": "abort"}),
        "POST /v1/weights/update": ("/v1/weights/update",
                                    {"policy_version": 99, "weights_path": "/tmp"}),
        "POST /v1/weights/resume": ("/v1/weights/resume", {"policy_version": 99}),
        "POST /v1/keys": ("/v1/keys", {"trainer_run": "evil"}),
        "GET /v1/keys": ("/v1/keys", None),
        "DELETE /v1/keys/{key_id}": (f"/v1/keys/{ids['key']}", None),
    }


def _routes(ids: dict[str, str]) -> list[tuple[str, str, Any]]:
    """Every route of the service (its schema's, and the schema itself), and its
    own session's end: (method, path, body)."""
    schema = service_schema(ServiceConfig(db=":memory:", token=TOKEN))
    served = {f"{m.upper()} {p}" for p, ops in schema["paths"].items() for m in ops
              if p != "/healthz"} | {"GET /openapi.json"}
    bodies = _bodies(ids)
    assert set(bodies) == served, "a route the harness is not told to try"
    return [(name.split()[0], path, body) for name, (path, body) in bodies.items()] + [
        ("POST", "/v1/sessions/{own_session}/end", {"reward": 1.0})]


def _report(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] \
        if path.exists() else []


def _wait_for(path: Path, what: str) -> list[dict[str, Any]]:
    """The report once an entry has `what`: looked at after each write in its folder
    (`until`'s inotify events), no deadline: a hang is pytest-timeout's."""
    until(lambda: any(what in entry for entry in _report(path)), lambda: None, path)
    return _report(path)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_harness_job_holds_its_sessions_key_only_and_scores_as_its_job_chose(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    end = tok.token_id("<|im_end|>")
    call, answer = [*tok.encode(TOOL_CALL), end], [*tok.encode(ANSWER), end]
    reports = tmp_path / "reports"
    reports.mkdir()
    routes, hold = reports / "routes.json", tmp_path / "hold"  # (the reports: in its sandbox)
    common = {"PROBE_PYTHON": sys.executable, "PROBE_SCRIPT": str(SCRIPT),
              "PROBE_ROUTES": str(routes), "PROBE_REPORT": str(reports / "plain.jsonl"),
              "PROBE_SANDBOX": "none"}
    plain = Harness("plain", (sys.executable, str(SCRIPT)),
                    env={**common, "PROBE_HOLD": str(hold)})
    boxed = Harness("boxed", (sys.executable, str(SCRIPT)), env={
        **common, "PROBE_SANDBOX": "bwrap", "PROBE_REPORT": str(reports / "boxed.jsonl"),
        "PROBE_OWN_REWARD": str(OWN_REWARD)})
    # Three runs one after another, two calls each: the command, then the answer.
    fake = FakeVLLMServer(script=[call, answer] * 3)
    with fake.serve() as engine_url:
        config = ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                               engines=[EngineRequest(url=engine_url, model="m")],
                               tokenizer=str(tmp_path / "tok"),
                               harnesses={"plain": plain, "boxed": boxed})
        with running_service(config) as url, \
                httpx.Client(base_url=url, timeout=60,
                             headers={"authorization": f"Bearer {TOKEN}"}) as admin:
            made = admin.post("/v1/keys", json={"trainer_run": "run-a"}).json()
            trainer = httpx.Client(base_url=url, timeout=60,
                                   headers={"authorization": f"Bearer {made['key']}"})
            # The trainer's other work, which nothing the harness holds may touch.
            other = trainer.post("/v1/sessions", json={}).json()
            assert trainer.post("/v1/jobs", json={"tasks": {"sessions": 1},
                                                  "job_id": "a-other"}).status_code == 201
            engine = admin.get("/v1/engines").json()[0]["engine_id"]
            routes.write_text(json.dumps(_routes({
                "other_session": other["session_id"], "job": "a-other", "engine": engine,
                "engine_url": engine_url, "key": made["key_id"]})))
            before = {"weights": admin.get("/v1/weights").json(),
                      "engines": _pool(admin),
                      "keys": admin.get("/v1/keys").json(),
                      "other": admin.get(f"/v1/sessions/{other['session_id']}").json(),
                      "job": admin.get("/v1/jobs/a-other").json()}

            def run(job_id: str, harness: str, score: str | None) -> dict[str, Any]:
                job = {"tasks": {"suite": "math", "tasks": [TASK],
                                 "options": {"python_tool": False}},
                       "harness": {"name": harness, **({"score": score} if score else {})},
                       "job_id": job_id}
                assert trainer.post("/v1/jobs", json=job).status_code == 201
                if harness == "plain" and not hold.exists():
                    # While the run is open, its session is treadle's to end.
                    seen = _wait_for(reports / "plain.jsonl", "environ")
                    sid = seen[0]["environ"]["TREADLE_SESSION_ID"]
                    assert admin.post(f"/v1/sessions/{sid}/end",
                                      json={"reward": 1.0}).status_code == 409
                    assert trainer.post(f"/v1/sessions/{sid}/end",
                                        json={"reward": 1.0}).status_code == 404
                    hold.touch()
                with trainer.stream("GET", f"/v1/jobs/{job_id}/trajectories",
                                    params={"follow": "true"}) as stream:
                    (line,) = [json.loads(x) for x in stream.iter_lines() if x]
                record: dict[str, Any] = line["trajectory"]
                return record

            verified = run("by-verifier", "plain", None)  # the default score
            by_exit = run("by-exit-code", "plain", "exit_code")
            by_file = run("by-reward-file", "boxed", "reward_file")
            after = {"weights": admin.get("/v1/weights").json(),
                     "engines": _pool(admin),
                     "keys": admin.get("/v1/keys").json(),
                     "other": admin.get(f"/v1/sessions/{other['session_id']}").json(),
                     "job": admin.get("/v1/jobs/a-other").json()}
            harness_job = admin.get("/v1/jobs/made-by-harness").status_code
            trainer.close()
    # Each run's reward comes from the source its job chose, and the record says so;
    # the reward file a model-written command wrote decided nothing.
    assert (verified["status"], verified["reward"], verified["reward_source"]) == (
        "completed", 0.0, "verifier")
    assert (by_exit["reward"], by_exit["reward_source"]) == (1.0, "exit_code")
    assert (by_file["reward"], by_file["reward_source"]) == (OWN_REWARD, "reward_file")
    # Nothing of the service or the trainer's other work changed.
    assert after == before and harness_job == 404
    plain_report, boxed_report = (_report(reports / "plain.jsonl"),
                                  _report(reports / "boxed.jsonl"))
    for entry in plain_report + boxed_report:
        if "environ" in entry:  # the harness's environment, and its commands'
            values = "\n".join(entry["environ"].values())
            assert TOKEN not in values and made["key"] not in values
            assert entry["environ"]["OPENAI_API_KEY"].startswith("sek_")
    # The harness and an unsandboxed command: every route refused (403) with the key
    # they hold, its own session's end and another session's included.
    tried = [e for e in plain_report if "route" in e]
    assert {(e["who"], e["route"]) for e in tried} >= {
        (who, "POST /v1/sessions/{own_session}/end") for who in ("harness", "command")}
    assert len(tried) == 2 * 2 * (len(_bodies({k: "x" for k in (
        "other_session", "job", "engine", "engine_url", "key")})) + 1)
    assert {e["status"] for e in tried} == {403}, [e for e in tried if e["status"] != 403]
    writes = [e for e in plain_report if "reward_file" in e]
    assert writes and {e["outcome"] for e in writes} == {"written"}  # and ignored
    # The sandboxing harness: refused the same; its command reaches no route at all
    # and cannot write the harness's reward file.
    boxed_tries = [e for e in boxed_report if "route" in e]
    assert {e["status"] for e in boxed_tries if e["who"] == "harness"} == {403}
    commands = [e["status"] for e in boxed_tries if e["who"] == "command"]
    assert commands and all(str(s).startswith("unreachable") for s in commands)
    (blocked,) = [e for e in boxed_report if e.get("reward_file", "").endswith("reward.json")
                  and e["reward_file"] != "reward.json"]
    assert blocked["outcome"].startswith("refused"), blocked


def _pool(admin: httpx.Client) -> list[dict[str, Any]]:
    """The engine pool, without each engine's load (a reading, not the pool's state)."""
    return [{k: v for k, v in e.items() if k != "load"} for e in admin.get("/v1/engines").json()]

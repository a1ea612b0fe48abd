"""Least privilege over real HTTP: trainer keys see and change their own run's jobs,
sessions and weights only (another run's job is a 404, as an unknown one); session
keys open their own session's OpenAI routes and tools only, and nothing once it has
ended;
every route declares the scope it needs."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from service_helpers import running_service, service_schema

from agent.agent_helpers import build_tokenizer
from treadle.cli import main
from treadle.service import dashboard, deps
from treadle.service.app import create_app
from treadle.service.keys import digest, file_line, new_key, read_keys_file
from treadle.service.limits import RequestGate
from treadle.service.routes import (
    engines,
    jobs,
    keys,
    openai,
    rollouts,
    sessions,
    system,
    weights,
)
from treadle.service.routes import status as status_routes
from treadle.service.state import ServiceConfig, build_service

pytestmark = [pytest.mark.integration]
TOKEN = "scopes-admin"
FILE_KEY = new_key("trk_")  # run-b's, from the keys file
ROUTERS = (system, jobs, rollouts, sessions, openai, engines, weights, keys,
           status_routes)  # all but
# health and the dashboard's files (test_the_dashboards_files_alone_need_no_key)
REPLAY = {"tasks": {"workload": "math", "trajectories": 2, "group_size": 2}}


def _config(tmp: Path, **more: Any) -> ServiceConfig:
    build_tokenizer(tmp / "tok")
    (tmp / "keys.txt").write_text(f"# run b\n{file_line('run-b', FILE_KEY)}\n")
    return ServiceConfig(db=str(tmp / "s.db"), token=TOKEN, emulate=1, time_scale=0.005,
                         policy="verl", tokenizer=str(tmp / "tok"),
                         trainer_keys=tuple(read_keys_file(tmp / "keys.txt")), **more)


def _as(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_service(_config(tmp_path_factory.mktemp("scopes"))) as base:
        yield base


@pytest.fixture(scope="module")
def admin(url: str) -> Iterator[httpx.Client]:
    with _as(url, TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def run_a(url: str, admin: httpx.Client) -> Iterator[httpx.Client]:
    made = admin.post("/v1/keys", json={"trainer_run": "run-a"})
    assert made.status_code == 201, made.text
    with _as(url, made.json()["key"]) as client:
        yield client


@pytest.fixture(scope="module")
def run_b(url: str) -> Iterator[httpx.Client]:
    with _as(url, FILE_KEY) as client:
        yield client


def _no_job(r: httpx.Response, job_id: str) -> None:
    """The answer an unknown job gets."""
    assert (r.status_code, r.json()) == (404, {"detail": f"no job {job_id!r}"}), r.text


# -- every route states its scope ------------------------------------------------------

SCOPES = {  # route -> the scope dependency it must declare
    "GET /metrics": deps.get_admin, "GET /openapi.json": deps.get_caller,
    "POST /v1/jobs": deps.get_caller, "GET /v1/jobs": deps.get_caller,
    "GET /v1/jobs/{job_id}": deps.get_owned_job,
    "GET /v1/jobs/{job_id}/timeline": deps.get_owned_job,
    "GET /v1/jobs/{job_id}/groups": deps.get_owned_job,
    "GET /v1/jobs/{job_id}/record": deps.get_owned_job,
    "POST /v1/jobs/{job_id}/metrics": deps.get_owned_job,
    "GET /v1/jobs/{job_id}/trajectories": deps.get_owned_job,
    "POST /v1/jobs/{job_id}/cancel": deps.get_owned_job,
    "POST /v1/jobs/{job_id}/take": deps.get_owned_job,
    "GET /v1/jobs/{job_id}/taken": deps.get_owned_job,
    "POST /v1/rollouts": deps.get_caller, "POST /v1/sessions": deps.get_caller,
    "GET /v1/sessions/{session_id}": deps.get_owned_session,
    "POST /v1/sessions/{session_id}/end": deps.get_owned_session,
    "POST /v1/sessions/{session_id}/openai/v1/chat/completions": deps.get_door,
    "GET /v1/sessions/{session_id}/openai/v1/models": deps.get_door,
    "GET /v1/sessions/{session_id}/tools": deps.get_door,
    "POST /v1/sessions/{session_id}/tools/{name}": deps.get_door,
    "GET /v1/engines": deps.get_caller, "POST /v1/engines": deps.get_admin,
    "POST /v1/engines/{engine_id}/drain": deps.get_admin,
    "DELETE /v1/engines/{engine_id}": deps.get_admin,
    "GET /v1/weights": deps.get_caller, "POST /v1/weights/pause": deps.get_caller,
    "POST /v1/weights/update": deps.get_caller, "POST /v1/weights/resume": deps.get_caller,
    "POST /v1/keys": deps.get_admin, "GET /v1/keys": deps.get_admin,
    "DELETE /v1/keys/{key_id}": deps.get_admin, "GET /v1/status": deps.get_admin,
}


def test_every_route_but_liveness_declares_the_scope_it_needs() -> None:
    schema = service_schema(ServiceConfig(db=":memory:", token=TOKEN))
    served = {f"{method.upper()} {path}" for path, ops in schema["paths"].items()
              for method in ops} | {"GET /openapi.json"}
    found = {}
    for route in [r for m in ROUTERS for r in m.router.routes]:
        if not isinstance(route, APIRoute):
            continue
        calls, stack = set(), list(route.dependant.dependencies)
        while stack:
            dep = stack.pop()
            calls.add(dep.call)
            stack.extend(dep.dependencies)
        for method in route.methods:
            found[f"{method} {route.path}"] = calls
    assert set(found) == set(SCOPES) == served - {"GET /healthz"}
    for name, scope in SCOPES.items():
        assert scope in found[name], f"{name} does not declare {scope.__name__}"
        if scope is deps.get_caller:  # not the admin's only
            assert deps.get_admin not in found[name], name


# -- trainer keys -------------------------------------------------------------------------


def test_a_trainer_key_sees_and_changes_only_its_own_runs_jobs(
        admin: httpx.Client, run_a: httpx.Client, run_b: httpx.Client) -> None:
    made = run_a.post("/v1/jobs", json={**REPLAY, "job_id": "job-of-a"})
    assert made.status_code == 201, made.text
    assert run_a.get("/v1/jobs/job-of-a").json()["trainer_run"] == "run-a"  # its run's
    # Another run's job answers as no job at all: reading, streaming, reporting on it
    # and cancelling it.
    _no_job(run_b.get("/v1/jobs/job-of-a"), "job-of-a")
    _no_job(run_b.get("/v1/jobs/job-of-a/trajectories"), "job-of-a")
    _no_job(run_b.post("/v1/jobs/job-of-a/metrics", json={"metrics": {"x": 1.0}}),
            "job-of-a")
    _no_job(run_b.post("/v1/jobs/job-of-a/cancel"), "job-of-a")
    for view in ("timeline", "groups", "record?trajectory_id=job-of-a/math-s0-g0000-r00"):
        _no_job(run_b.get(f"/v1/jobs/job-of-a/{view}"), "job-of-a")
    _no_job(run_b.get("/v1/jobs/nothing-here"), "nothing-here")
    # Nor listed: each run lists its own jobs, the admin every job.
    assert "job-of-a" not in {j["job_id"] for j in run_b.get("/v1/jobs").json()}
    assert {j["owner"] for j in run_a.get("/v1/jobs").json()} == {"run-a"}
    assert "job-of-a" in {j["job_id"] for j in admin.get("/v1/jobs").json()}
    # Nothing of it changed; its run's key and the admin see it whole.
    with run_a.stream("GET", "/v1/jobs/job-of-a/trajectories",
                      params={"follow": "true"}) as stream:
        assert stream.status_code == 200
        assert sum(1 for line in stream.iter_lines() if line) == 2
    view = run_a.get("/v1/jobs/job-of-a").json()
    assert (view["status"], view["trainer_metrics"]) == ("completed", {})
    assert admin.get("/v1/jobs/job-of-a").status_code == 200
    # It submits for its own run's weights only.
    other = run_b.post("/v1/jobs", json={**REPLAY, "trainer_run": "run-a"})
    assert other.status_code == 403 and "run 'run-b'" in other.json()["detail"]
    mine = run_b.post("/v1/jobs", json={**REPLAY, "trainer_run": "run-b"})
    assert mine.status_code == 201, mine.text
    assert run_b.post(f"/v1/jobs/{mine.json()['job_id']}/cancel").status_code == 200


def test_a_trainer_key_pushes_its_own_runs_weights_only(
        admin: httpx.Client, run_b: httpx.Client) -> None:
    before = admin.get("/v1/weights").json()
    for path, body in (("/v1/weights/resume", {"policy_version": 9, "trainer_run": "run-a"}),
                       ("/v1/weights/update", {"policy_version": 9, "trainer_run": "run-a",
                                               "weights_path": "/nonexistent"})):
        refused = run_b.post(path, json=body)
        assert refused.status_code == 403, refused.text
        assert admin.get("/v1/weights").json() == before  # nothing paused or pushed
    assert run_b.post("/v1/weights/pause", json={"mode": "wait"}).status_code == 200
    # Named or not, what it pushes is its own run's.
    pushed = run_b.post("/v1/weights/resume", json={"policy_version": 3}).json()
    assert (pushed["policy_version"], pushed["trainer_run"], pushed["paused"]) == (
        3, "run-b", False)
    assert admin.post("/v1/weights/pause", json={}).status_code == 200
    assert admin.post("/v1/weights/resume", json={"policy_version": 0}).json()[
        "trainer_run"] is None


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/engines", {"url": "http://127.0.0.1:9"}),
    ("POST", "/v1/engines/e0/drain", None), ("DELETE", "/v1/engines/e0", None),
    ("GET", "/metrics", None), ("POST", "/v1/keys", {"trainer_run": "run-b"}),
    ("GET", "/v1/keys", None), ("DELETE", "/v1/keys/anything", None),
    ("GET", "/v1/status", None),
])
def test_a_trainer_key_is_refused_the_admins_routes(
        run_b: httpx.Client, admin: httpx.Client, method: str, path: str,
        body: dict[str, Any] | None) -> None:
    engines = [e["engine_id"] for e in admin.get("/v1/engines").json()]
    r = run_b.request(method, path, json=body)
    assert r.status_code == 403, r.text
    assert r.json() == {"detail": "this route needs the service token"}
    assert [e["engine_id"] for e in admin.get("/v1/engines").json()] == engines
    assert run_b.get("/v1/engines").status_code == 200  # reading the pool is open to it


def test_the_key_list_shows_no_key_and_a_file_key_is_revoked_in_the_file(
        admin: httpx.Client, run_a: httpx.Client) -> None:
    listed = admin.get("/v1/keys")
    assert listed.status_code == 200 and "trk_" not in listed.text
    assert FILE_KEY not in listed.text
    runs = {(k["trainer_run"], k["source"]) for k in listed.json()}
    assert {("run-a", "api"), ("run-b", "file")} <= runs
    file_id = next(k["key_id"] for k in listed.json() if k["source"] == "file")
    refused = admin.delete(f"/v1/keys/{file_id}")
    assert refused.status_code == 409 and "keys file" in refused.json()["detail"]
    assert admin.delete("/v1/keys/k-nothing").status_code == 404


# -- session keys -------------------------------------------------------------------------


def _session(client: httpx.Client, **body: Any) -> dict[str, Any]:
    made = client.post("/v1/sessions", json=body)
    assert made.status_code == 201, made.text
    info: dict[str, Any] = made.json()
    assert info["api_key"].startswith("sek_")
    return info


def _door(info: dict[str, Any], url: str) -> str:
    return info["base_url"].removeprefix(url)


def test_a_session_key_opens_its_own_sessions_openai_routes_and_nothing_else(
        url: str, admin: httpx.Client, run_a: httpx.Client, run_b: httpx.Client) -> None:
    a, b = _session(run_a), _session(run_b)
    job = run_a.post("/v1/jobs", json={**REPLAY, "job_id": "a-for-session-key"})
    assert job.status_code == 201
    with _as(url, a["api_key"]) as key_a:
        assert key_a.get(f"{_door(a, url)}/models").json()["data"][0]["id"] == "policy"
        # Its own session's tools: opened, but a session made through the API is
        # served none (a harness job's is: test_service_harness_tools.py).
        tools = key_a.get(f"/v1/sessions/{a['session_id']}/tools")
        assert tools.status_code == 404 and "is served no tools" in tools.json()["detail"]
        with httpx.Client(base_url=url) as nobody:
            assert nobody.get(f"/v1/sessions/{a['session_id']}/tools").status_code == 401
            assert nobody.post(f"/v1/sessions/{a['session_id']}/tools/bash",
                               json={}).status_code == 401
        refused = [
            key_a.get(f"{_door(b, url)}/models"),
            key_a.post(f"{_door(b, url)}/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            key_a.get(f"/v1/sessions/{a['session_id']}"),
            key_a.post(f"/v1/sessions/{a['session_id']}/end", json={"reward": 1.0}),
            key_a.post(f"/v1/sessions/{b['session_id']}/end", json={"reward": 1.0}),
            key_a.post("/v1/sessions", json={"parent_session_id": a["session_id"]}),
            key_a.get("/v1/jobs/a-for-session-key"),
            key_a.post("/v1/jobs/a-for-session-key/cancel"),
            key_a.post("/v1/weights/resume", json={"policy_version": 5}),
            key_a.get("/v1/engines"), key_a.get("/metrics"), key_a.get("/openapi.json"),
            key_a.get("/v1/jobs"), key_a.get("/v1/status"),
            key_a.get("/v1/jobs/a-for-session-key/timeline"),
            key_a.post("/v1/keys", json={"trainer_run": "x"}),
            key_a.get(f"{_door(a, url)}/../../../../jobs"),
            # Another session's tools; a path under its own tools that names none.
            key_a.get(f"/v1/sessions/{b['session_id']}/tools"),
            key_a.post(f"/v1/sessions/{b['session_id']}/tools/bash", json={"command": "id"}),
            key_a.post(f"/v1/sessions/{a['session_id']}/tools/bash/x", json={}),
            key_a.post(f"/v1/sessions/{a['session_id']}/tools/", json={}),
        ]
        assert [r.status_code for r in refused] == [403] * len(refused)
        # Nothing happened: both sessions are open, the job not cancelled.
        assert admin.get(f"/v1/sessions/{b['session_id']}").json()["status"] == "running"
        assert admin.get("/v1/jobs/a-for-session-key").json()["status"] != "cancelled"
        # Its session ended by its owner, the key opens nothing at all.
        assert run_a.post(f"/v1/sessions/{a['session_id']}/end",
                          json={"reward": 1.0}).status_code == 200
        gone = key_a.get(f"{_door(a, url)}/models")
        assert gone.status_code == 401
    assert admin.post(f"/v1/sessions/{b['session_id']}/end", json={}).status_code == 200


def test_a_trainers_session_is_its_own_and_a_key_dies_however_its_session_ends(
        url: str, admin: httpx.Client, run_a: httpx.Client, run_b: httpx.Client) -> None:
    a = _session(run_a, limits={"idle_timeout_s": 0.2})
    sid = a["session_id"]
    # Another run sees no such session: not to view, end, use or make a sub-agent of.
    unknown = {"detail": f"no open session {sid!r}"}
    assert run_b.get(f"/v1/sessions/{sid}").json() == unknown
    ended = run_b.post(f"/v1/sessions/{sid}/end", json={"reward": 1.0})
    assert (ended.status_code, ended.json()) == (404, unknown)
    sub = run_b.post("/v1/sessions", json={"parent_session_id": sid})
    assert sub.status_code == 404
    door = run_b.get(f"{_door(a, url)}/models")
    assert door.status_code == 404 and door.json()["error"]["code"] == "session_not_found"
    assert run_a.get(f"{_door(a, url)}/models").status_code == 200  # its owner's key
    # Nor join another run's sessions job (it reads as no job).
    job = run_a.post("/v1/jobs", json={"tasks": {"sessions": 1}, "job_id": "a-sessions"})
    assert job.status_code == 201, job.text
    joined = run_b.post("/v1/sessions", json={"job_id": "a-sessions"})
    assert joined.status_code == 422 and "no job 'a-sessions'" in joined.text
    # The session ends by itself (idle): its key is refused from then on.
    with _as(url, a["api_key"]) as key_a:
        # (Ended by the gateway, it waits out its grace for its owner: still viewable.)
        # Looked at until it ends (in 0.2-1.2 s); no deadline: a hang is pytest's.
        while admin.get(f"/v1/sessions/{sid}").json().get("status") == "running":
            time.sleep(0.05)
        assert key_a.get(f"{_door(a, url)}/models").status_code == 401


def test_a_session_key_is_refused_before_its_body_is_read(
        url: str, run_a: httpx.Client) -> None:
    a = _session(run_a)
    host, port = httpx.URL(url).host, httpx.URL(url).port
    for key, status in ((a["api_key"], 403), ("sek_made-up", 401)):
        sock = socket.create_connection((host, port))
        try:
            # Headers announcing half a MiB that is never sent: answered at once.
            sock.sendall(("\r\n".join([
                "POST /v1/jobs HTTP/1.1", f"host: {host}", "content-type: application/json",
                "content-length: 524288", f"authorization: Bearer {key}"]) + "\r\n\r\n"
            ).encode())
            sock.settimeout(60)  # a bound for a hang: the answer comes at once
            assert int(sock.recv(65536).split(b"\r\n", 1)[0].split()[1]) == status
        finally:
            sock.close()
    assert run_a.post(f"/v1/sessions/{a['session_id']}/end", json={}).status_code == 200


def test_trainer_keys_made_through_the_api_outlive_a_restart_until_revoked(
        tmp_path: Path) -> None:
    config = _config(tmp_path)
    with running_service(config) as url, _as(url, TOKEN) as admin:
        made = admin.post("/v1/keys", json={"trainer_run": "run-c"}).json()
        with _as(url, made["key"]) as run_c:
            assert run_c.post("/v1/jobs", json={**REPLAY, "job_id": "c1"}).status_code == 201
    raw = Path(config.db).read_bytes()
    assert made["key"].encode() not in raw  # the store keeps a digest only
    with running_service(config) as url, _as(url, TOKEN) as admin, \
            _as(url, made["key"]) as run_c, _as(url, FILE_KEY) as run_b:
        assert run_c.get("/v1/jobs/c1").status_code == 200
        _no_job(run_b.get("/v1/jobs/c1"), "c1")  # its owner is kept too
        assert admin.delete(f"/v1/keys/{made['key_id']}").status_code == 204
        assert run_c.get("/v1/jobs/c1").status_code == 401
        assert admin.get("/v1/jobs/c1").status_code == 200


def test_a_session_a_trainer_ends_is_its_runs_and_scored_by_its_owner(
        url: str, run_a: httpx.Client, run_b: httpx.Client) -> None:
    a = _session(run_a)
    with _as(url, a["api_key"]) as key_a:  # a call served: a trajectory to score
        served = key_a.post(f"{_door(a, url)}/chat/completions", json={
            "model": "policy", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2})
        assert served.status_code == 200, served.text
    ended = run_a.post(f"/v1/sessions/{a['session_id']}/end", json={"reward": 0.5})
    assert ended.status_code == 200
    # The job made for it is run-a's: its stream is run-a's to read, no one else's.
    _no_job(run_b.get(f"/v1/jobs/{a['job_id']}/trajectories"), a["job_id"])
    with run_a.stream("GET", f"/v1/jobs/{a['job_id']}/trajectories") as stream:
        (line,) = [x for x in stream.iter_lines() if x]
    record = json.loads(line)["trajectory"]
    assert (record["reward"], record["reward_source"]) == (0.5, "owner")


def test_the_dashboards_files_alone_need_no_key(url: str, run_a: httpx.Client) -> None:
    """The page and its files are the package's bytes for everyone (no data in them),
    with a policy that lets no other script run; anything else still needs a key."""
    with httpx.Client(base_url=url, timeout=60) as anyone:
        page = anyone.get("/dashboard")
        assert page.status_code == 200 and page.content == dashboard.asset("dashboard.html")
        assert page.headers["content-security-policy"] == dashboard.CSP
        assert "script-src 'self' 'sha256-" in dashboard.CSP and "unsafe-eval" not in dashboard.CSP
        for path in sorted(dashboard.PUBLIC_PATHS - {dashboard.PAGE}):
            served = anyone.get(path)
            assert served.status_code == 200, path
            assert served.content == dashboard.asset(path.removeprefix(dashboard.STATIC))
        refused = [anyone.get("/dashboard/static/nothing.js"),
                   anyone.get("/dashboard/static/dashboard.html"),
                   anyone.get("/dashboard/static/..%2F..%2Fv1%2Fjobs"),
                   anyone.post("/dashboard", content=b"x" * 1024),
                   anyone.get("/dashboard/"), anyone.get("/v1/jobs")]
        assert [r.status_code for r in refused] == [401] * len(refused)
    assert run_a.get("/dashboard/static/nothing.js").status_code == 404  # (with a key)


def test_the_routes_check_every_scope_without_the_gate(tmp_path: Path) -> None:
    """The gate refuses wrong keys first; the routes' own scope dependencies hold
    without it (an app mounted some other way)."""
    config = _config(tmp_path)
    config.emulate = 0
    service = build_service(config)
    app = create_app(service)
    app.user_middleware = [m for m in app.user_middleware if m.cls is not RequestGate]
    with TestClient(app) as client:
        def call(key: str, method: str, path: str, body: Any = None) -> int:
            r = client.request(method, path, json=body,
                               headers={"authorization": f"Bearer {key}"})
            return r.status_code

        a_key = client.post("/v1/keys", json={"trainer_run": "run-a"},
                            headers={"authorization": f"Bearer {TOKEN}"}).json()["key"]
        assert call(a_key, "POST", "/v1/jobs", {**REPLAY, "job_id": "j-a"}) == 201
        a = client.post("/v1/sessions", json={},
                        headers={"authorization": f"Bearer {a_key}"}).json()
        b = client.post("/v1/sessions", json={},
                        headers={"authorization": f"Bearer {TOKEN}"}).json()
        door_a, door_b = (f"/v1/sessions/{s['session_id']}/openai/v1/models" for s in (a, b))
        assert call("sek_nothing", "GET", "/v1/weights") == 401
        assert call(a["api_key"], "GET", door_a) == 200
        assert [call(a["api_key"], *req) for req in (
            ("GET", door_b), ("GET", "/v1/jobs/j-a"), ("GET", "/v1/weights"),
            ("POST", f"/v1/sessions/{a['session_id']}/end", {}), ("GET", "/metrics"),
        )] == [403] * 5
        assert call(FILE_KEY, "GET", "/v1/jobs/j-a") == 404
        assert call(FILE_KEY, "GET", door_a) == 404
        assert call(FILE_KEY, "POST", f"/v1/sessions/{a['session_id']}/end", {}) == 404
        assert call(FILE_KEY, "GET", "/v1/keys") == 403
        assert call(FILE_KEY, "POST", "/v1/weights/resume",
                    {"policy_version": 1, "trainer_run": "run-a"}) == 403
        assert call(a_key, "GET", "/v1/jobs/j-a") == 200


def test_keys_new_writes_a_digest_and_serve_takes_keys_only_with_a_token(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.txt"
    assert main(["keys", "new", "run-7", "--file", str(keys)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("trk_") and key not in keys.read_text()
    assert [(k.trainer_run, k.digest) for k in read_keys_file(keys)] == [
        ("run-7", digest(key))]
    assert main(["keys", "new", "no spaces", "--file", str(keys)]) == 2
    assert main(["serve", "--keys", str(keys), "--db", ":memory:"]) == 2
    assert "--keys needs --token" in capsys.readouterr().err
    keys.write_text("run-8 sha256:123\n")
    assert main(["serve", "--keys", str(keys), "--token", "t", "--db", ":memory:"]) == 2
    assert f"{keys}:1: not 'TRAINER_RUN sha256:" in capsys.readouterr().err

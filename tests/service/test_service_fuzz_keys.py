"""The API and gateway routes fuzzed (schemathesis, from the service's own schema) with
keys of the wrong scope, over real HTTP.

Every generated request — schema-valid and schema-breaking, on every route — is sent
with each of these keys, and no answer may be a 5xx or reach past its scope:

- a key the service never made, a session key whose session has ended, a trainer
  key the admin revoked: 401, always;
- session A's key, aimed at session B's routes and at every other route: 403,
  always (its own OpenAI routes are the only ones it opens, test_service_scopes.py);
- trainer B's key, aimed at trainer A's job and sessions: never a 2xx there, on the
  admin's routes a 403 (or the 422 of a body FastAPI cannot read, before any
  route's scope is looked at), and for A's job the very answer a job that does not
  exist gets (sent again with an unknown id), so that ids cannot be probed; the
  job list it gets never names A's job.

Afterwards nothing of A's or the admin's changed: A's job, A's session, the engines,
the keys and the weights' run. What trainer B may do is undone at once: its jobs
cancelled, a pause resumed. Examples are derandomized.
"""

from __future__ import annotations

import collections
import json
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from service_helpers import running_service, service_schema

from agent.agent_helpers import build_tokenizer
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "fuzz-keys-admin"
A_JOB = "job-of-a"
UNKNOWN_JOB = "no-such-job-0"
EXAMPLES = 12  # per route and phase, each sent with five keys (six for another's job)

TOKENIZER = Path(tempfile.mkdtemp(prefix="treadle-fuzz-keys-tok-"))
build_tokenizer(TOKENIZER)
ADMIN_ROUTES = {"POST /v1/engines", "POST /v1/engines/{engine_id}/drain",
                "DELETE /v1/engines/{engine_id}", "GET /metrics", "POST /v1/keys",
                "GET /v1/keys", "DELETE /v1/keys/{key_id}", "GET /v1/status"}
A_SCOPED = ("/v1/jobs/{job_id}", "/v1/sessions/{session_id}")  # trainer A's, by path


def _config(db: str) -> ServiceConfig:
    return ServiceConfig(db=db, token=TOKEN, emulate=1, time_scale=0.02, policy="verl",
                         max_live=64, max_queued=8192, engine_wait_s=2.0,
                         tokenizer=str(TOKENIZER))


schema = schemathesis.openapi.from_dict(service_schema(_config(":memory:"))).exclude(
    path="/healthz")  # (which needs no key)
# The examples and fuzzing phases only: the coverage phase sends every boundary value
# of every field (some 770 cases for POST /v1/jobs alone, 2 of this suite's minutes),
# which is what tests/service/test_service_fuzz.py checks the answers to; whose key
# may reach a route does not depend on a body's boundary values.
schema.config.phases.coverage.enabled = False
answers: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("fuzz-keys") / "fuzz.db"
    with running_service(_config(str(db))) as url, \
            httpx.Client(base_url=url, headers=_auth(TOKEN), timeout=60) as admin, \
            httpx.Client(timeout=60) as http:
        keys = {run: admin.post("/v1/keys", json={"trainer_run": run}).json()
                for run in ("run-a", "run-b", "run-gone")}
        assert admin.delete(f"/v1/keys/{keys['run-gone']['key_id']}").status_code == 204

        def session(run: str) -> dict[str, Any]:
            made = httpx.post(f"{url}/v1/sessions", headers=_auth(keys[run]["key"]),
                              json={"limits": {"max_turns": 10_000, "idle_timeout_s": 86400.0}},
                              timeout=60)
            assert made.status_code == 201, made.text
            info: dict[str, Any] = made.json()
            return info

        ended = session("run-a")
        assert admin.post(f"/v1/sessions/{ended['session_id']}/end",
                          json={}).status_code == 200
        a_job = httpx.post(f"{url}/v1/jobs", headers=_auth(keys["run-a"]["key"]), timeout=60,
                           json={"tasks": {"workload": "math", "trajectories": 4, "group_size": 2},
                                 "job_id": A_JOB})
        assert a_job.status_code == 201, a_job.text
        with admin.stream("GET", f"/v1/jobs/{A_JOB}/trajectories",
                          params={"follow": "true"}) as stream:
            assert sum(1 for line in stream.iter_lines() if line) == 4
        world = {"url": url, "admin": admin, "http": http, "keys": keys,
                 "a_session": session("run-a"),
                 "b_session": session("run-b"), "expired": ended["api_key"],
                 "engines": admin.get("/v1/engines").json()}
        world["before"] = _state(world)
        yield world


def _state(world: dict[str, Any]) -> dict[str, Any]:
    """What no wrong key may change: A's job and session, the engines, the keys."""
    admin: httpx.Client = world["admin"]
    job = admin.get(f"/v1/jobs/{A_JOB}").json()
    session = admin.get(f"/v1/sessions/{world['a_session']['session_id']}").json()
    return {"job": {k: job[k] for k in ("status", "delivered", "trainer_metrics")},
            "session": session, "engines": [e["engine_id"] for e in
                                            admin.get("/v1/engines").json()],
            "keys": admin.get("/v1/keys").json()}


def _send(case: schemathesis.Case, world: dict[str, Any], key: str,
          **ids: str) -> tuple[int, str]:
    """(status, body) of the case sent with `key`, its path's named ids replaced."""
    for name, value in ids.items():
        if case.path_parameters and name in case.path_parameters:
            case.path_parameters[name] = value
    if case.query and "follow" in case.query:
        case.query["follow"] = "false"  # a followed stream of a fuzzed job may wait for ever
    # Sent here, not with case.call: schemathesis drops the Authorization header of
    # the cases it makes to probe a missing key, and every request here has one.
    sent = case.as_transport_kwargs(base_url=world["url"])
    headers = {k: v for k, v in sent["headers"].items() if k.lower() != "authorization"}
    body: dict[str, Any] = {}
    if "json" in sent:
        body["content"] = json.dumps(sent["json"]).encode()
    elif "data" in sent:
        body["content"] = sent["data"]
    r = world["http"].request(sent["method"], sent["url"], params=sent.get("params"),
                              headers={**headers, **_auth(key)}, **body)
    return r.status_code, r.text


def _bad_input(body: str) -> bool:
    """A 422 for the request's own shape: its body, query or path, not its scope."""
    detail = json.loads(body)["detail"]
    return isinstance(detail, list) and all(
        e["loc"][0] in ("body", "query", "path") for e in detail)


def _undo(world: dict[str, Any], route: str, status: int, body: str) -> None:
    """What trainer B may do, undone at once: its jobs cancelled (the engines stay
    idle), a pause resumed (a rollout would wait for ever on a paused runtime)."""
    if route == "POST /v1/jobs" and status == 201:
        job = json.loads(body)["job_id"]
        assert world["admin"].post(f"/v1/jobs/{job}/cancel").status_code == 200
    if route == "POST /v1/weights/pause" and status == 200:
        resumed = world["admin"].post("/v1/weights/resume", json={"policy_version": 0})
        assert resumed.status_code == 200


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_key_reaches_past_its_scope_and_none_is_a_5xx(
        case: schemathesis.Case, world: dict[str, Any]) -> None:
    route = f"{case.method} {case.path}"
    keys = world["keys"]
    a_sid, b_sid = world["a_session"]["session_id"], world["b_session"]["session_id"]
    pick = zlib.crc32(json.dumps(case.path_parameters or {}, sort_keys=True).encode())
    # Unknown, expired, revoked: 401 whatever the route.
    for key in (f"trk_{pick:x}-made-up", world["expired"], keys["run-gone"]["key"]):
        status, body = _send(case, world, key, job_id=A_JOB, session_id=a_sid)
        answers[f"{route} 401"][status] += 1
        assert status == 401, (route, status, body)
    # Session A's key on session B's routes and on every other route: 403.
    status, body = _send(case, world, world["a_session"]["api_key"], job_id=A_JOB,
                         session_id=b_sid)
    answers[f"{route} session"][status] += 1
    assert status == 403, (route, status, body)
    # Trainer B's key: the admin's routes are a 403, A's job and sessions out of reach.
    status, body = _send(case, world, keys["run-b"]["key"], job_id=A_JOB, session_id=a_sid)
    answers[f"{route} trainer"][status] += 1
    assert status < 500, (route, status, body)
    _undo(world, route, status, body)
    if route in ADMIN_ROUTES:
        # (A body FastAPI cannot read is refused before any route's scope is looked at.)
        assert status == 403 or (status == 422 and _bad_input(body)), (route, status, body)
    elif route == "GET /v1/jobs" and status == 200:
        assert A_JOB not in {job["job_id"] for job in json.loads(body)}, body  # nor listed
    elif case.path.startswith(A_SCOPED):
        assert not 200 <= status < 300, (route, status, body)
        if "{job_id}" in case.path:
            # The same request for a job that does not exist gets the same answer.
            other = _send(case, world, keys["run-b"]["key"], job_id=UNKNOWN_JOB)
            assert other == (status, body.replace(A_JOB, UNKNOWN_JOB)), (route, body, other)


def test_nothing_of_a_or_the_admin_changed_and_every_route_was_fuzzed(
        world: dict[str, Any]) -> None:
    """Runs after the fuzz, in file order."""
    if not answers:
        pytest.fail("the fuzz test did not run before this one (run the whole file)")
    operations = {f"{op.method.upper()} {op.path}"
                  for op in (r.ok() for r in schema.get_all_operations())}
    # (schemathesis also sends the methods a path lacks: they are answered too)
    assert operations <= {route.rsplit(" ", 1)[0] for route in answers}
    print("\n" + "\n".join(f"{route}: {dict(sorted(codes.items()))}"
                           for route, codes in sorted(answers.items())))
    assert _state(world) == world["before"]
    assert world["admin"].get("/v1/weights").json()["trainer_run"] != "run-a"

"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis) over real HTTP.

A real service on loopback (uvicorn in a thread, emulated engine processes, a
bearer token, a SQLite file) gets generated requests for every route — valid ones
and, in schemathesis's negative mode, ones that break the schema — and every
answer is checked: never a 5xx, the status code, content type, headers and body as
the schema declares them, a schema-breaking request refused, the token enforced,
an unsupported method a 405 with its Allow header.

What the fuzz leaves out, and why:

- ``follow=true`` on the NDJSON stream is sent as ``follow=false``: a followed
  stream waits for its job to end, and the fuzz's jobs may wait for ever (a
  generated ``min_policy_version`` no weight update reaches, a paused runtime).
  Followed streams are tested on short jobs in test_service_e2e.py.
- schemathesis's ``positive_data_acceptance`` check: the schema cannot say what
  the service refuses for reasons of its state — a suite with no tokenizer loaded,
  an engine URL where nothing answers, a workload size not a multiple of its group
  size — so a schema-valid request answered with a field-level 422 is no defect.

Every job the fuzz manages to submit is cancelled at once, so the engines stay
idle and the run stays short. Half of the generated job ids are replaced by the
id of a finished job (and half the trajectory ids by one of its trajectories') and
a quarter of the engine ids by a live engine's, so the routes' paths past the 404
are fuzzed too; half of the session ids by an open
session's (a fresh one for each call that ends a session, so that every end can
succeed), so the gateway's chat completions are fuzzed past its 404 on a real
session with emulated engines (OpenAI-shaped errors, never a 5xx); and half of the
key ids by a trainer key made for the call (so that each revocation can succeed).
Examples are derandomized (same schema, same requests).
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
from schemathesis.specs.openapi.checks import positive_data_acceptance
from service_helpers import running_service, service_schema

from agent.agent_helpers import build_tokenizer
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "fuzz-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
KNOWN_JOB = "fuzz-known"  # a small finished job the fuzz's job routes also hit
KNOWN_CONTINUOUS = "fuzz-continuous"  # a continuous job the take routes also hit
EXAMPLES = 150  # per route and phase; about a minute for the whole run on 2 cores


TOKENIZER = Path(tempfile.mkdtemp(prefix="treadle-fuzz-tok-"))
build_tokenizer(TOKENIZER)  # the sessions' (a tiny BPE trained here)


def _config(db: str) -> ServiceConfig:
    # Small queue limits: a generated 65,536-trajectory job is refused with a 503
    # (declared) once a few are queued, instead of keeping the engines busy.
    return ServiceConfig(db=db, token=TOKEN, emulate=2, time_scale=0.02, policy="verl",
                         max_live=64, max_queued=8192, engine_wait_s=2.0,
                         tokenizer=str(TOKENIZER))


# The schema of an app configured like the one under test.
schema = schemathesis.openapi.from_dict(service_schema(_config(":memory:")))
# Configured, not passed per call: schemathesis's auth probes then know the token is
# the real one and drop or spoil it to see the 401.
schema.config.update(headers={"Authorization": f"Bearer {TOKEN}"})
answers: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    with running_service(_config(str(db))) as url, \
            httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 16},
                                          "job_id": KNOWN_JOB})
        assert r.status_code == 201, r.text
        with client.stream("GET", f"/v1/jobs/{KNOWN_JOB}/trajectories",
                           params={"follow": "true"}) as stream:
            done = [json.loads(line)["trajectory"]["trajectory_id"]
                    for line in stream.iter_lines() if line]
            assert len(done) == 16
        r = client.post("/v1/jobs", json={
            "tasks": {"workload": "short", "trajectories": 8, "group_size": 2},
            "continuous": {"in_flight": 2, "budget": 64}, "job_id": KNOWN_CONTINUOUS})
        assert r.status_code == 201, r.text
        engines = [e["engine_id"] for e in client.get("/v1/engines").json()]

        def session() -> str:
            created = client.post("/v1/sessions", json={"limits": {"max_turns": 10_000}})
            assert created.status_code == 201, created.text
            return str(created.json()["session_id"])

        def key() -> str:
            made = client.post("/v1/keys", json={"trainer_run": "fuzz-run"})
            assert made.status_code == 201, made.text
            return str(made.json()["key_id"])

        yield {"url": url, "client": client, "engines": engines, "session": session,
               "known_session": session(), "key": key, "trajectories": done}


def _aim(case: schemathesis.Case, service: dict[str, Any]) -> None:
    """Point some path parameters at what exists; never follow a stream."""
    params = case.path_parameters or {}
    engines = service["engines"]
    # One engine to drain, the other to delete: a drained engine is gone once idle.
    mine = engines[:1] if case.path.endswith("/drain") else engines[1:]
    sessions = [service["session"]() if case.path.endswith("/end")
                else service["known_session"]]
    keys = [service["key"]()] if "key_id" in params else []  # one to revoke, each time
    takes = case.path.endswith(("/take", "/taken"))
    body = case.body if isinstance(case.body, dict) else {}
    wait = body.get("wait_s", 0.0)
    if takes and isinstance(wait, int | float) and not isinstance(wait, bool) \
            and 0 <= wait <= 60:  # (a bad one stays as generated)
        body["wait_s"] = 0.0  # what is there now: a fuzz does not wait for groups
    for name, known in (("job_id", [KNOWN_CONTINUOUS if takes else KNOWN_JOB]),
                        ("engine_id", mine),
                        ("session_id", sessions), ("key_id", keys)):
        value = params.get(name)
        if isinstance(value, str) and known:
            pick = zlib.crc32(value.encode())
            share = 4 if name == "engine_id" else 2
            if pick % share == 0:
                params[name] = known[(pick // share) % len(known)]
    if case.query and "follow" in case.query:
        case.query["follow"] = "false"
    given = (case.query or {}).get("trajectory_id")
    if isinstance(given, str) and zlib.crc32(given.encode()) % 2 == 0:
        case.query["trajectory_id"] = service["trajectories"][0]  # a finished one's


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_5xx_and_every_answer_matches_the_schema(
        case: schemathesis.Case, service: dict[str, Any]) -> None:
    _aim(case, service)
    response = case.call(base_url=service["url"], timeout=60)
    answers[f"{case.method} {case.path}"][response.status_code] += 1
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    if case.method == "POST" and case.path == "/v1/jobs" and response.status_code == 201:
        job = json.loads(response.content)["job_id"]
        cancelled = service["client"].post(f"/v1/jobs/{job}/cancel")
        # A short replay may end before the cancel reaches it; a cancel leaves an
        # ended job as it is.
        assert cancelled.status_code == 200
        assert cancelled.json()["status"] in ("cancelled", "completed")


def test_the_fuzz_reached_past_validation_on_every_route_that_can_succeed(
        service: dict[str, Any]) -> None:
    """A fuzz answered only 4xx would prove little: the routes a generated request
    can succeed on each answered 2xx at least once. (POST /v1/engines needs a
    healthy engine at the URL and POST /v1/rollouts a tokenizer, so a 422 is their
    best; a session's tools are served only to a harness job's run in a sandbox,
    test_service_harness_tools.py, so a 404 is theirs.) Runs after the fuzz, in file
    order."""
    if not answers:
        pytest.fail("the fuzz test did not run before this one (run the whole file)")
    assert all(code < 500 for codes in answers.values() for code in codes)
    cannot = {"POST /v1/engines", "POST /v1/rollouts", "GET /v1/sessions/{session_id}/tools",
              "POST /v1/sessions/{session_id}/tools/{name}"}
    operations = {f"{op.method.upper()} {op.path}"
                  for op in (r.ok() for r in schema.get_all_operations())}
    print("\n" + "\n".join(f"{route}: {dict(sorted(answers[route].items()))}"
                           for route in sorted(operations)))
    missed = sorted(route for route in operations - cannot
                    if not any(200 <= code < 300 for code in answers.get(route, {})))
    assert not missed, f"no 2xx on {missed}"

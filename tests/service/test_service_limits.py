"""Bad input is refused with the right status, found by the API fuzz
(test_service_fuzz.py) or by reading the limits; one regression test each, over
real HTTP to a real service."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service

from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration]
TOKEN = "limits-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
LINE = {"id": "t1", "group": "g1", "prompt_tokens": 8,
        "turns": [{"output_tokens": 4, "tool_latency_s": 0, "tool_output_tokens": 0}]}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    db = tmp_path_factory.mktemp("limits") / "t.db"
    config = ServiceConfig(db=str(db), token=TOKEN, emulate=2, time_scale=0.02,
                           policy="verl", max_body_bytes=1 << 20, max_queued=64)
    with running_service(config) as url, \
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
        yield c


def _locs(r: httpx.Response) -> list[tuple[Any, ...]]:
    assert r.status_code == 422, r.text
    return [tuple(d["loc"]) for d in r.json()["detail"]]


def test_a_stream_cursor_beyond_64_bits_is_a_422_not_a_broken_stream(
        client: httpx.Client) -> None:
    # It reached SQLite, which raised OverflowError after the 200 had been sent.
    assert client.post("/v1/jobs", json={"tasks": {"trace": [LINE]},
                                         "job_id": "cursor"}).status_code == 201
    r = client.get("/v1/jobs/cursor/trajectories", params={"after": 1 << 63})
    assert ("query", "after") in _locs(r)
    assert client.get("/v1/jobs/cursor/trajectories",
                      params={"after": (1 << 63) - 1}).text == ""


@pytest.mark.parametrize("url", ["http://engine:abc", "https://\ud8b9\udddf", "http://:80"])
def test_an_engine_url_the_client_cannot_parse_is_a_field_error(
        client: httpx.Client, url: str) -> None:
    # The engine client's constructor raised (httpx.InvalidURL, an IDNA error): a 500.
    body = json.dumps({"url": url}, ensure_ascii=True)  # a lone surrogate, escaped
    r = client.post("/v1/engines", content=body, headers={"content-type": "application/json"})
    assert _locs(r) == [("body", "url")]


def test_a_chunked_body_over_the_limit_is_a_413(client: httpx.Client) -> None:
    # Without a content-length the limit tripped inside FastAPI's body reader, which
    # answered 400 for it.
    chunks = (b" " * (256 << 10) for _ in range(8))
    r = client.post("/v1/jobs", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json() == {"detail": "request body too large"}


@pytest.mark.parametrize("body", [b'{"job_id": "\xff"}', b'{"tasks": ' * 3000])
def test_a_body_that_is_not_json_text_is_a_422(client: httpx.Client, body: bytes) -> None:
    # Not UTF-8, or nested past the parser's recursion limit: FastAPI answered 400.
    r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert _locs(r) == [("body",)]


@pytest.mark.parametrize(("path", "body", "loc"), [
    ("/v1/weights/resume", {"policy_version": False}, ("body", "policy_version")),
    ("/v1/weights/resume", {"policy_version": "3"}, ("body", "policy_version")),
    ("/v1/weights/resume", {"policy_version": 1 << 63}, ("body", "policy_version")),
    ("/v1/jobs", {"tasks": {"workload": "math", "trajectories": 16.0}},
     ("body", "tasks", "replay", "trajectories")),
    ("/v1/jobs", {"tasks": {"trace": [{**LINE, "prompt_tokens": "8"}]}},
     ("body", "tasks", "replay", "trace", 0, "prompt_tokens")),
])
def test_a_value_of_the_wrong_json_type_or_past_64_bits_is_refused(
        client: httpx.Client, path: str, body: dict[str, Any], loc: tuple[Any, ...]) -> None:
    # Lax validation took false for 0 and "3" for 3.
    assert loc in _locs(client.post(path, json=body))


def test_a_method_the_path_lacks_is_a_405_naming_every_method_it_has(
        client: httpx.Client) -> None:
    # Starlette named the first route's methods only (GET), not POST.
    r = client.put("/v1/engines")
    assert r.status_code == 405
    assert r.headers["allow"] == "GET, POST"


def test_a_trace_line_longer_than_the_model_window_is_refused_before_it_runs(
        client: httpx.Client) -> None:
    # The replay built the line's synthetic context in memory, on the event loop:
    # a billion-token prompt stalled the service and took gigabytes.
    line = {**LINE, "id": "t2", "prompt_tokens": 1_000_000_000}
    r = client.post("/v1/jobs", json={"tasks": {"trace": [LINE, line]}, "job_id": "long"})
    assert _locs(r) == [("body", "tasks", "trace", "1")]
    assert "40960" in r.text
    assert client.get("/v1/jobs/long").status_code == 404


def test_a_job_past_the_queue_limit_is_a_503_and_nothing_is_stored(
        client: httpx.Client) -> None:
    # Nothing bounded the trajectories queued across jobs (a few 65,536-trajectory
    # jobs held gigabytes). These wait for a policy version no update reaches.
    waiting = {"tasks": {"workload": "math", "trajectories": 48},
               "min_policy_version": 1 << 40}
    assert client.post("/v1/jobs", json={**waiting, "job_id": "q1"}).status_code == 201
    r = client.post("/v1/jobs", json={**waiting, "job_id": "q2"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert "over the limit of 64" in r.json()["detail"]
    assert client.get("/v1/jobs/q2").status_code == 404
    assert client.get("/v1/jobs/q1").json()["queued"] == 48
    client.post("/v1/jobs/q1/cancel")
    assert client.post("/v1/jobs", json={**waiting, "job_id": "q3"}).status_code == 201
    client.post("/v1/jobs/q3/cancel")


def test_suite_tasks_times_samples_past_the_job_limit_is_refused(
        client: httpx.Client) -> None:
    r = client.post("/v1/jobs", json={"tasks": {"suite": "math", "count": 65_536},
                                      "samples_per_task": 2})
    assert _locs(r) == [("body", "samples_per_task")]


def test_the_schema_declares_the_token_and_every_route_its_errors(
        client: httpx.Client) -> None:
    assert httpx.get(f"{client.base_url}/openapi.json").status_code == 401  # behind the token
    assert client.get("/docs").status_code == 404  # no docs UI
    # Without the token nothing but /healthz answers, not even whether a path exists.
    assert httpx.get(f"{client.base_url}/docs").status_code == 401
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if path == "/healthz":
                assert "security" not in op
                continue
            assert op["security"] == [{"HTTPBearer": []}], (method, path)
            assert {"401", "413", "503"} <= set(op["responses"]), (method, path)


def test_without_a_token_the_schema_declares_no_auth(tmp_path: Path) -> None:
    with running_service(ServiceConfig(db=str(tmp_path / "t.db"))) as url:
        schema = httpx.get(f"{url}/openapi.json").json()
        assert "securitySchemes" not in schema.get("components", {})
        assert httpx.get(f"{url}/v1/weights").json() == {"policy_version": 0, "paused": False,
                                                         "trainer_run": None,
                                                         "frozen_policy_version": None}

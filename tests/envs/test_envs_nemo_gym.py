"""The NeMo Gym adapter against a real HTTP server on 127.0.0.1 (a test double)."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from envs_helpers import play, run

from treadle.envs import EnvConfigError, ResourcesServerError, TaskFormatError, get_suite
from treadle.envs.adapters.nemo_gym import NemoGymSuite

TOOLS = [
    {"type": "function", "name": "push", "description": "Push a number onto the stack.",
     "parameters": {"type": "object", "properties": {"value": {"type": "integer"}},
                    "required": ["value"], "additionalProperties": False}},
    {"type": "function", "name": "total", "description": "Sum of the stack.",
     "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
]


def row(target: int, row_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"Push numbers that add up to {target}."}],
            "tools": TOOLS},
        "target": target, "verifier_metadata": {"note": "kept verbatim"}}
    if row_id is not None:
        out["id"] = row_id
    return out


class FakeResourcesServerHandler(BaseHTTPRequestHandler):
    """A resources server double: per-session stacks keyed by a session cookie."""

    server: FakeResourcesServer

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def _reply(self, status: int, body: Any, cookie: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if cookie:
            self.send_header("Set-Cookie", f"session={cookie}; Path=/")
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        cookie = (self.headers.get("Cookie") or "").removeprefix("session=") or None
        srv = self.server
        srv.requests.append((self.path, cookie, body))
        if self.path == "/seed_session":
            sid = secrets.token_hex(4)
            srv.stacks[sid] = []
            return self._reply(200, {}, cookie=sid)
        if cookie not in srv.stacks:
            return self._reply(400, {"detail": "no session"})
        stack = srv.stacks[cookie]
        if self.path == "/push":
            if not isinstance(body.get("value"), int):
                return self._reply(422, {"detail": "value must be an integer"})
            stack.append(body["value"])
            return self._reply(200, {"stack": stack})
        if self.path == "/total":
            return self._reply(200, {"total": sum(stack)})
        if self.path == "/verify":
            if srv.broken_verify:
                return self._reply(500, {"detail": "judge unavailable"})
            ok = sum(stack) == body["target"] and body["response"]["object"] == "response"
            return self._reply(200, {**body, "reward": float(ok), "pushes": len(stack)})
        return self._reply(404, {"detail": f"no endpoint {self.path}"})


class FakeResourcesServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeResourcesServerHandler)
        self.stacks: dict[str, list[int]] = {}
        self.requests: list[tuple[str, str | None, Any]] = []
        self.broken_verify = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server() -> Iterator[FakeResourcesServer]:
    srv = FakeResourcesServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.mark.integration
def test_episode_against_a_resources_server(server: FakeResourcesServer) -> None:
    suite = get_suite("nemo_gym", base_url=server.url, rows=[row(7, "seven"), row(3)])
    assert [t.task_id for t in suite.tasks(seed=0)] == [t.task_id for t in suite.tasks(seed=0)]
    task = next(t for t in suite.tasks() if t.task_id == "seven")
    assert task.prompt == [{"role": "user", "content": "Push numbers that add up to 7."}]

    async def episode() -> None:
        good, results = await play(suite, task, None, [
            ("push", {"value": 3}), ("push", '{"value": 4}'), ("total", {}),
            ("push", {"value": "x"})], final_message="Done: 3 + 4.")
        assert [r.ok for r in results] == [True, True, True, False]
        assert json.loads(results[2].output) == {"total": 7}
        assert "must be integer" in (results[3].error or "")  # checked before any HTTP
        assert good.reward == 1.0 and good.metrics["pushes"] == 2.0
        bad, _ = await play(suite, task, None, [("push", {"value": 1})])
        assert bad.reward == 0.0

    run(episode())
    seeds = [r for r in server.requests if r[0] == "/seed_session"]
    assert len(seeds) == 2 and seeds[0][2]["verifier_metadata"] == {"note": "kept verbatim"}
    assert "id" not in seeds[0][2]
    verify = next(r for r in server.requests if r[0] == "/verify")
    output = verify[2]["response"]["output"]
    assert [o["type"] for o in output[:2]] == ["function_call", "function_call_output"]
    assert output[0]["name"] == "push" and json.loads(output[0]["arguments"]) == {"value": 3}
    assert output[-1]["content"][0]["text"] == "Done: 3 + 4."
    # each episode has its own session: the two episodes' cookies differ
    cookies = {c for path, c, _ in server.requests if path == "/verify"}
    assert len(cookies) == 2


@pytest.mark.integration
def test_server_side_tool_errors_are_observations(server: FakeResourcesServer) -> None:
    loose = [{**TOOLS[0], "parameters": {"type": "object", "properties": {}}}]
    suite = NemoGymSuite(server.url, rows=[{**row(1), "responses_create_params": {
        "input": "push 1", "tools": loose}}])
    [task] = suite.tasks()

    async def episode() -> None:
        _, results = await play(suite, task, None, [("push", {"value": "x"}),
                                                    ("nope", {})])
        assert results[0].error == "the tool server answered HTTP 422", results[0]
        assert "value must be an integer" in results[0].output
        assert results[1].error is not None and "unknown tool 'nope'" in results[1].error

    run(episode())


@pytest.mark.integration
def test_infrastructure_failures_raise(server: FakeResourcesServer) -> None:
    suite = NemoGymSuite(server.url, rows=[row(2)], timeout_s=5)
    [task] = suite.tasks()
    server.broken_verify = True
    with pytest.raises(ResourcesServerError, match="HTTP 500"):
        run(play(suite, task, None, [("push", {"value": 2})]))
    server.broken_verify = False
    dead = NemoGymSuite("http://127.0.0.1:9", rows=[row(2)], timeout_s=2)  # discard port
    with pytest.raises(ResourcesServerError, match="seed_session"):
        run(play(dead, dead.tasks()[0], None, []))


def test_row_format_is_checked() -> None:
    suite = NemoGymSuite("http://127.0.0.1:1")
    task = suite.task_from_record(row(5))
    assert task.task_id.startswith("nemo-") and suite.task_from_record(row(5)).task_id == \
        task.task_id
    assert suite.task_to_record(suite.task_from_record(row(5, "r"))) == row(5, "r")
    bad: dict[str, Any]
    for bad in ({}, {"responses_create_params": {}},
                {"responses_create_params": {"input": 3}},
                {"responses_create_params": {"input": "x", "tools": [{"type": "function"}]}}):
        with pytest.raises(TaskFormatError):
            suite.task_from_record(bad)
    with pytest.raises(EnvConfigError):
        NemoGymSuite("127.0.0.1:8000")
    with pytest.raises(EnvConfigError, match="base_url"):
        get_suite("nemo_gym")

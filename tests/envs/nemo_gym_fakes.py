"""FakeNemoGymServer: a test double of a NeMo Gym resources server, on 127.0.0.1.

It is no NeMo Gym code: a stdlib HTTP server that speaks NeMo Gym's wire protocol as
NeMo Gym's own source defines it (github.com/NVIDIA-NeMo/Gym):

- ``nemo_gym/base_resources_server.py``: the routes ``/seed_session``, ``/verify``
  and ``/close_session`` (``SimpleResourcesServer.setup_webserver``); a
  resources-session seed (``ResourcesSeedSessionRequest``: exactly
  ``resources_session_id``, ``episode_id``, ``task_id``, ``task_data``) answered with
  ``resources_session_id`` echoed, ``resources_tools`` and ``sandbox_access``; a
  close (``ResourcesCloseSessionRequest``: exactly ``resources_session_id`` and
  ``episode_id``) answered with ``resources_session_id``; the verify answer
  (``BaseVerifyResponse``: ``reward``, ``mask_sample``, ``failure_kind``,
  ``failure_reason``); ``MCPServerMetadata`` and the ``X-NeMo-Gym-Session-Token``
  header name.
- ``nemo_gym/episode_types.py``: ``EpisodeId`` (``rollout_id`` in
  ``[A-Za-z0-9][A-Za-z0-9._-]*``, not ending in ``-a<N>``; ``attempt`` >= 0) and
  ``TaskId`` (``taskset``, ``task_id``, optional ``revision``), extra keys refused.
- ``nemo_gym/judge.py``: ``judge_failsafe``, the answer of a verify whose judge
  failed (a placeholder reward 0.0 with ``mask_sample``, ``failure_kind``
  ``"judge_failed"``, ``failure_reason``, ``instance_config.mask_sample`` and the
  older ``_ng_failure_class`` / ``_ng_failure_judge_error`` keys; servers before the
  three fields answer only the older keys).
- ``nemo_gym/server_utils.py``: the session middleware, which sets the session
  cookie on every answer (a request without one starts a new session).
- ``nemo_gym/mcp_auto_exposure.py``: a stateless JSON-RPC MCP endpoint at ``/mcp``
  (406 unless the client accepts both JSON and event streams); ``tools/list`` needs
  no token, ``tools/call`` runs the tool route for the token's session, a tool's
  failure is an ``isError`` result; a legacy seed answer carries the MCP access
  under ``mcp``.
- ``resources_servers/example_session_state_mgmt/app.py``: a server that takes both
  seeds; a resources-session seed keys the state by ``resources_session_id`` (the
  cookie's session becomes it), a closed session refuses tools (409) and a second
  seed, a close naming another episode is refused (409).
- ``resources_servers/example_mcp_weather/app.py``: a legacy-only seed model that
  allows extra fields, so it takes a resources-session seed as a row and answers
  without the echo (``legacy_only``).

The tools are a per-session stack: ``/push {"value": int}`` and ``/total``; a row's
``initial`` seeds the stack and ``/verify`` scores ``sum(stack) == target``.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COOKIE = "FakeNemoGymServer___fake"  # NeMo Gym names it <server class>___<instance name>
TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_RESERVED_TAIL = re.compile(r"-a[1-9][0-9]*$")
MCP_TOOLS = [
    {"name": "push", "description": "Push a number onto the stack.",
     "inputSchema": {"type": "object", "properties": {"value": {"type": "integer"}},
                     "required": ["value"]}},
    {"name": "total", "description": "Sum of the stack.",
     "inputSchema": {"type": "object", "properties": {}}},
]


@dataclass
class SeenRequest:
    """One request as the server got it."""

    path: str
    session: str | None  # the session cookie it carried (None: it started one)
    body: Any
    headers: dict[str, str]


@dataclass
class _State:
    stack: list[int]
    episode_id: dict[str, Any] | None = None  # bound by a resources-session seed


@dataclass
class _Reply:
    status: int
    body: Any


class _TaggedError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def _check_keys(value: Any, required: set[str], optional: set[str], what: str) -> None:
    if not isinstance(value, dict) or not required <= set(value) <= required | optional:
        raise _TaggedError(422, f"{what}: keys must be {sorted(required)} (+{sorted(optional)})")


def _check_episode_id(value: Any) -> None:
    _check_keys(value, {"rollout_id"}, {"attempt"}, "episode_id")
    rollout = value["rollout_id"]
    if (not isinstance(rollout, str) or not _ROLLOUT_ID.match(rollout)
            or _RESERVED_TAIL.search(rollout)):
        raise _TaggedError(422, f"episode_id.rollout_id is malformed: {rollout!r}")
    attempt = value.get("attempt", 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise _TaggedError(422, "episode_id.attempt must be an integer >= 0")


class FakeNemoGymServer(ThreadingHTTPServer):
    """The double; see the module docstring. Its switches are plain attributes."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.requests: list[SeenRequest] = []
        self.sessions: dict[str, _State] = {}
        self.closed: set[str] = set()
        self.tokens: dict[str, str] = {}  # MCP session token -> session id
        # Switches.
        self.verify_mode = "score"  # score | judge_failed | legacy_judge_failed | degraded | 500
        self.legacy_only = False  # take any seed as a legacy row (no resources sessions)
        self.has_close_route = True
        self.expose_mcp = False
        self.seed_status = 200  # anything else: /seed_session fails with it
        # Hold /push until `release` is set, after setting `tool_entered` (abort tests).
        self.hold_tools = False
        self.tool_entered = threading.Event()
        self.release = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def seen(self, path: str) -> list[SeenRequest]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    # -- routes ----------------------------------------------------------------------

    def route(self, path: str, session: str, body: Any,
              headers: dict[str, str]) -> tuple[_Reply, str]:
        """The answer to one request, and the session its cookie carries back."""
        if path == "/seed_session":
            return self._seed(session, body)
        if path == "/close_session":
            return self._close(body), session
        if path == "/verify":
            return self._verify(session, body), session
        if path == "/mcp":
            return self._mcp(body, headers), session
        return self._tool(path.lstrip("/"), session, body), session

    def _mcp_access(self, session: str) -> dict[str, Any]:
        token = f"tok-{secrets.token_hex(8)}"
        self.tokens[token] = session
        return {"server_name": "fake", "url_path": "/mcp", "transport": "http",
                "headers": {TOKEN_HEADER: token}}

    def _seed(self, session: str, body: Any) -> tuple[_Reply, str]:
        if self.seed_status != 200:
            return _Reply(self.seed_status, {"detail": "seeding failed"}), session
        if isinstance(body, dict) and "resources_session_id" in body and not self.legacy_only:
            _check_keys(body, {"resources_session_id", "episode_id", "task_id", "task_data"},
                        set(), "seed")
            _check_episode_id(body["episode_id"])
            _check_keys(body["task_id"], {"taskset", "task_id"}, {"revision"}, "task_id")
            sid = body["resources_session_id"]
            if not isinstance(sid, str) or not sid or sid in self.closed:
                raise _TaggedError(409, "Resources session is closed")
            self.sessions[sid] = _State(list(body["task_data"].get("initial", [])),
                                        body["episode_id"])
            # The cookie's session becomes the resources session.
            return _Reply(200, {"resources_session_id": sid,
                                "resources_tools": self._mcp_access(sid)
                                if self.expose_mcp else None,
                                "sandbox_access": None}), sid
        row = body if isinstance(body, dict) else {}
        self.sessions[session] = _State(list(row.get("initial", [])))
        return _Reply(200, {"mcp": self._mcp_access(session)} if self.expose_mcp else {}), session

    def _close(self, body: Any) -> _Reply:
        if not self.has_close_route:
            return _Reply(404, {"detail": "Not Found"})
        _check_keys(body, {"resources_session_id", "episode_id"}, set(), "close")
        _check_episode_id(body["episode_id"])
        sid = body["resources_session_id"]
        state = self.sessions.get(sid)
        if state is not None and state.episode_id not in (None, body["episode_id"]):
            raise _TaggedError(409, "Resources session belongs to another episode")
        self.sessions.pop(sid, None)
        self.closed.add(sid)
        return _Reply(200, {"resources_session_id": sid})

    def _state(self, session: str) -> _State:
        if session in self.closed:
            raise _TaggedError(409, "Resources session is closed")
        state = self.sessions.get(session)
        if state is None:
            raise _TaggedError(400, "no seeded session")
        return state

    def _tool(self, name: str, session: str, body: Any) -> _Reply:
        stack = self._state(session).stack
        if name == "push":
            if self.hold_tools:
                self.tool_entered.set()
                self.release.wait(30)  # a safety bound; tests set `release`
            if not isinstance(body, dict) or type(body.get("value")) is not int:
                raise _TaggedError(422, "value must be an integer")
            stack.append(body["value"])
            return _Reply(200, {"stack": list(stack)})
        if name == "total":
            return _Reply(200, {"total": sum(stack)})
        raise _TaggedError(404, f"no endpoint /{name}")

    def _verify(self, session: str, body: Any) -> _Reply:
        if not isinstance(body, dict) or not {"responses_create_params", "response"} <= set(body):
            raise _TaggedError(422, "verify: responses_create_params and response are required")
        if self.verify_mode == "500":
            return _Reply(500, {"detail": "verifier crashed"})
        stack = self.sessions.get(session, _State([])).stack
        ok = sum(stack) == body.get("target") and body["response"].get("object") == "response"
        answer = {**body, "reward": float(ok), "pushes": len(stack)}
        error = "TimeoutError: judge unavailable"
        if self.verify_mode == "judge_failed":  # judge_failsafe, with the three fields
            answer |= {"reward": 0.0, "mask_sample": True, "failure_kind": "judge_failed",
                       "failure_reason": error, "instance_config": {"mask_sample": True},
                       "_ng_failure_class": "judge_failed", "_ng_failure_judge_error": error}
        elif self.verify_mode == "legacy_judge_failed":  # judge_failsafe before them
            answer |= {"reward": 0.0, "_ng_failure_class": "judge_failed",
                       "_ng_failure_judge_error": error}
        elif self.verify_mode == "degraded":  # measured validly, with a failure named
            answer |= {"mask_sample": False, "failure_kind": "tool_output_truncated",
                       "failure_reason": "the tool log was cut at 1 MiB"}
        return _Reply(200, answer)

    def _mcp(self, body: Any, headers: dict[str, str]) -> _Reply:
        accept = headers.get("accept", "")
        if "application/json" not in accept or "text/event-stream" not in accept:
            return _Reply(406, {"jsonrpc": "2.0", "id": "server-error", "error": {
                "code": -32600, "message": "Not Acceptable: Client must accept both "
                                           "application/json and text/event-stream"}})
        if not isinstance(body, dict) or body.get("jsonrpc") != "2.0" or "id" not in body:
            return _Reply(400, {"detail": "not a JSON-RPC request"})
        params = body.get("params") or {}
        if body.get("method") == "tools/list":  # one tool a page, to make clients page
            start = int(params.get("cursor") or 0)
            result: dict[str, Any] = {"tools": MCP_TOOLS[start:start + 1]}
            if start + 1 < len(MCP_TOOLS):
                result["nextCursor"] = str(start + 1)
        elif body.get("method") == "tools/call":
            result = self._mcp_call(params, headers.get(TOKEN_HEADER.lower()))
        else:
            return _Reply(200, {"jsonrpc": "2.0", "id": body["id"],
                                "error": {"code": -32601, "message": "Method not found"}})
        return _Reply(200, {"jsonrpc": "2.0", "id": body["id"], "result": result})

    def _mcp_call(self, params: dict[str, Any], token: str | None) -> dict[str, Any]:
        session = self.tokens.get(token or "")
        try:
            if session is None:
                raise _TaggedError(401, f"Missing {TOKEN_HEADER} for Gym MCP tool call.")
            payload = self._tool(str(params.get("name")), session, params.get("arguments"))
        except _TaggedError as e:
            return {"content": [{"type": "text", "text": f"HTTP {e.status}: {e.detail}"}],
                    "isError": True}
        return {"content": [{"type": "text", "text": json.dumps(payload.body)}],
                "structuredContent": payload.body, "isError": False}


class _Handler(BaseHTTPRequestHandler):
    server: FakeNemoGymServer

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        cookies = SimpleCookie(self.headers.get("Cookie") or "")
        carried = cookies[COOKIE].value if COOKIE in cookies else None
        headers = {k.lower(): v for k, v in self.headers.items()}
        srv = self.server
        session = carried or f"cookie-{secrets.token_hex(6)}"  # the middleware starts one
        try:
            body = json.loads(raw or b"null")
        except json.JSONDecodeError:
            return self._send(_Reply(422, {"detail": "body is not JSON"}), session)
        with srv.lock:
            srv.requests.append(SeenRequest(self.path, carried, body, headers))
        if srv.hold_tools and self.path == "/push":  # a held tool must not block the others
            return self._send(*self._answer(session, body, headers))
        with srv.lock:
            reply, session = self._answer(session, body, headers)
        self._send(reply, session)

    def _answer(self, session: str, body: Any, headers: dict[str, str]) -> tuple[_Reply, str]:
        try:
            return self.server.route(self.path, session, body, headers)
        except _TaggedError as e:
            return _Reply(e.status, {"detail": e.detail}), session

    def _send(self, reply: _Reply, session: str) -> None:
        data = json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Set-Cookie", f"{COOKIE}={session}; Path=/; HttpOnly")
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def serving(server: FakeNemoGymServer) -> Iterator[FakeNemoGymServer]:
    """Serve `server` on a thread for the block; held tools are released on the way out."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


"""An adapter for NeMo Gym resources servers: their tasks, tools and verifier as a suite.

A NeMo Gym resources server is an HTTP app with ``POST /seed_session`` (start an
episode's state), one ``POST /<tool name>`` endpoint per tool (JSON arguments in,
JSON out), ``POST /verify`` (the episode's response in, ``{"reward": ...}`` out),
``POST /close_session`` (release the episode's state; NeMo Gym 0.7) and, when it
exposes its tools over MCP, an MCP endpoint at ``/mcp``. Episode state is keyed by
the session cookie the server sets, so each episode here has its own cookie jar,
and every call of an episode carries it. Wire formats: `nemo_gym_wire`.

Task format: NeMo Gym's dataset rows, unchanged::

    {"responses_create_params": {"input": [{"role": "developer", "content": "..."},
                                           {"role": "user", "content": "..."}],
                                 "tools": [{"type": "function", "name": "get_weather",
                                            "description": "...", "parameters": {...}}]},
     "expected_answer": "...", "id": "optional"}

``responses_create_params.input`` (a string, or messages) becomes the task prompt:
roles user/assistant/system/developer, a developer message rendered as the system
message (treadle's Qwen/Hermes format has no developer turn), text content only.
``tools`` (Responses-API function tools) become the episode's tools. Every other
field is the server's (verifier data) and is sent back untouched. ``id`` (optional,
a string or an integer) is the task id; rows without one get a stable hash id.

Per episode (``session_protocol="resources_session"``, the default): `setup` posts
``{resources_session_id, episode_id, task_id, task_data}`` to ``/seed_session`` (both
ids are assigned here, before the seed, so that a lost answer cannot hide the
session from its close) and requires the server to echo ``resources_session_id``;
``session_protocol="legacy"`` posts the row itself, as servers before NeMo Gym's
resources sessions expect. Each tool call posts its arguments to ``/<name>`` (an
HTTP error status is an observation: the server refused the arguments). `reward`
posts the row plus ``response``, a Responses-API object built from the episode, and
returns the server's ``reward``. `teardown` posts ``{resources_session_id,
episode_id}`` to ``/close_session`` exactly once, however the episode ended (scored,
failed or cancelled); a server without that route (HTTP 404/405) needs no close,
and a close that fails is logged, never raised (it must not hide the episode's end).

``mcp_tools=True``: the constructor lists the server's MCP tools once (one blocking
``tools/list`` at ``/mcp``, at most ``timeout_s``), and each episode offers those of
them its row does not declare; they are called with MCP ``tools/call`` and the
session token its ``/seed_session`` answer handed out.

Infrastructure failures raise `ResourcesServerError`, and no reward is invented:
the server unreachable or timing out, a ``/seed_session`` or ``/verify`` that fails
or answers no finite reward, and a ``/verify`` that masks its sample
(``mask_sample``, or a pre-0.7 judge failsafe's ``_ng_failure_class``): its reward
(a placeholder 0.0) measures the environment, not the policy, so the trajectory is
an excluded ``error/eval`` one whose reason keeps ``failure_kind`` and
``failure_reason`` (`MaskedSampleError`). An unmasked answer that names a failure
is a valid, degraded score: it stands, and `RewardResult.detail` keeps both fields.
Blocking HTTP runs in a worker thread (stdlib ``urllib``), never on the event loop.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import logging
import math
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.envs.adapters.nemo_gym_wire import (
    MCP_PATH,
    McpAccess,
    McpTool,
    call_mcp_tool,
    list_mcp_tools,
    parse_seed_answer,
    parse_verify_answer,
    post_json,
    prompt_messages,
    rollout_id,
)
from treadle.envs.base import RewardResult, Suite
from treadle.envs.errors import EnvConfigError, ResourcesServerError, TaskFormatError
from treadle.envs.records import rng_for, stable_id
from treadle.envs.tools.base import (
    DEFAULT_MAX_OUTPUT_CHARS,
    Tool,
    ToolContext,
    ToolReplay,
    ToolResult,
    clip,
)
from treadle.types import Task

log = logging.getLogger(__name__)
_OPENER = "nemo_gym.opener"  # ToolContext.state key of the episode's cookie-keeping opener
_SESSION = "nemo_gym.session"  # ToolContext.state key of the episode's `_Session`
PROTOCOLS = ("resources_session", "legacy")
# Answers to /close_session that mean the server has no such route (it predates it).
_NO_CLOSE_ROUTE = (404, 405)


class MaskedSampleError(ResourcesServerError):
    """``/verify`` answered a masked sample: its reward measures an environment
    failure, so the trajectory is excluded. Carries NeMo Gym's two failure fields."""

    def __init__(self, failure_kind: str | None, failure_reason: str | None) -> None:
        self.failure_kind, self.failure_reason = failure_kind, failure_reason
        super().__init__(f"/verify answered a masked sample (its reward measures no policy): "
                         f"failure_kind={failure_kind!r}, "
                         f"failure_reason={clip(failure_reason or '', 500)!r}")


@dataclass(slots=True)
class _Session:
    """One episode's identity at the server, assigned before its seed."""

    resources_session_id: str
    episode_id: dict[str, Any]  # NeMo Gym's EpisodeId: {"rollout_id", "attempt"}
    mcp: McpAccess | None = None  # the MCP access its seed handed out, if any

    @classmethod
    def new(cls, task_id: str) -> _Session:
        unique = uuid.uuid4().hex
        return cls(f"treadle-{unique}", {"rollout_id": rollout_id(task_id, unique[:16]),
                                         "attempt": 0})


def _opener(ctx: ToolContext) -> urllib.request.OpenerDirector:
    opener = ctx.state.get(_OPENER)
    if opener is None:  # one cookie jar per episode: the server keys sessions by cookie
        opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        ctx.state[_OPENER] = opener
    return opener


class _ServerTool(Tool):
    """A tool of the resources server, described by a function spec."""

    # An external server's state is out of treadle's reach: resuming keeps only the
    # turns before its first call.
    replay = ToolReplay.OPAQUE

    def __init__(self, suite: NemoGymSuite, name: str, description: str,
                 parameters: Mapping[str, Any] | None) -> None:
        self.suite = suite
        self._name, self._description = name, description
        self._parameters = dict(parameters or {"type": "object", "properties": {}})

    @property
    def name(self) -> str:
        return self._name

    @property
    def description(self) -> str:
        return self._description

    @property
    def parameters(self) -> dict[str, Any]:
        return self._parameters


class ResourcesServerTool(_ServerTool):
    """A tool the row declares: ``POST /<name>`` with the episode's cookie."""

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        status, text, _ = await asyncio.to_thread(
            post_json, _opener(ctx), f"{self.suite.base_url}/{self._name}", arguments,
            self.suite.timeout_s)
        output = clip(text, self.suite.max_output_chars)
        if status >= 400:
            return ToolResult(output=output, error=f"the tool server answered HTTP {status}")
        return ToolResult(output=output)


class McpServerTool(_ServerTool):
    """A tool the server lists over MCP: ``tools/call`` with the episode's session token."""

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        session = ctx.state.get(_SESSION)
        access = session.mcp if isinstance(session, _Session) else None
        if access is None:
            raise ResourcesServerError(f"tool {self._name!r} is served over MCP, but this "
                                       "episode's /seed_session handed out no MCP access")
        url = f"{self.suite.base_url}/{access.url_path.lstrip('/')}"
        text, failed = await asyncio.to_thread(call_mcp_tool, url, self._name, arguments,
                                               headers=access.headers,
                                               timeout_s=self.suite.timeout_s)
        output = clip(text, self.suite.max_output_chars)
        if failed:
            return ToolResult(output=output, error="the tool server answered an MCP tool error")
        return ToolResult(output=output)


class NemoGymSuite(Suite):
    """Tasks of one resources server; see the module docstring."""

    name = "nemo_gym"
    file_options = ("rows_path",)

    def __init__(self, base_url: str, *, rows: Sequence[Mapping[str, Any]] | None = None,
                 rows_path: str | Path | None = None, timeout_s: float = 60.0,
                 model: str = "treadle", max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
                 session_protocol: str = "resources_session", taskset: str = "treadle",
                 mcp_tools: bool = False) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise EnvConfigError(f"base_url must be an http(s) URL, got {base_url!r}")
        if session_protocol not in PROTOCOLS:
            raise EnvConfigError(f"session_protocol must be one of {', '.join(PROTOCOLS)}, "
                                 f"got {session_protocol!r}")
        if not isinstance(taskset, str) or not taskset:
            raise EnvConfigError(f"taskset must be a non-empty string, got {taskset!r}")
        if (not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool)
                or not 0 < timeout_s < math.inf):
            raise EnvConfigError(f"timeout_s must be a positive number of seconds, got "
                                 f"{timeout_s!r}")
        if not isinstance(mcp_tools, bool):
            raise EnvConfigError(f"mcp_tools must be true or false, got {mcp_tools!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.model = model
        self.max_output_chars = max_output_chars
        self.session_protocol = session_protocol
        self.taskset = taskset
        self._rows: list[Task] = [self.task_from_record(r) for r in rows or ()]
        if rows_path is not None:
            self._rows += self.load_tasks(rows_path)
        # Listed once: every episode of this server offers the same MCP tools.
        self.mcp_tools: list[McpTool] = (
            list_mcp_tools(f"{self.base_url}{MCP_PATH}", timeout_s) if mcp_tools else [])

    def needs_sandbox(self, task: Task) -> bool:
        return False  # the server owns whatever runs

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` of the rows given to the constructor (None: all), in a seeded order."""
        order = list(self._rows)
        rng_for(self.name, seed).shuffle(order)
        if n is not None and not 0 <= n <= len(order):
            raise ValueError(f"n must be between 0 and {len(order)}, got {n}")
        return order[:n]

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        if not isinstance(record, Mapping):
            raise TaskFormatError(f"a row must be a JSON object, got {type(record).__name__}")
        params = record.get("responses_create_params")
        if not isinstance(params, dict) or "input" not in params:
            raise TaskFormatError("field 'responses_create_params' must be an object with "
                                  "'input'")
        prompt = prompt_messages(params["input"])
        for tool in params.get("tools") or []:
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise TaskFormatError("each of 'responses_create_params.tools' needs a 'name'")
        row = json.loads(json.dumps(dict(record)))  # a private deep copy, JSON-clean
        task_id = row.get("id")
        if task_id is None:
            row.pop("id", None)
            task_id = stable_id("nemo", row)
        elif isinstance(task_id, str) and task_id:
            row.pop("id")
        elif isinstance(task_id, int) and not isinstance(task_id, bool):
            # NeMo Gym's own rows number their ids; the integer stays in the row, so the
            # record round-trips and the server gets the row as it was written.
            task_id = str(task_id)
        else:
            raise TaskFormatError("field 'id' must be a non-empty string or an integer")
        return Task(task_id=task_id, prompt=prompt, suite=self.name, metadata=row)

    def tools(self, task: Task) -> list[Tool]:
        specs = task.metadata["responses_create_params"].get("tools") or []
        out: list[Tool] = [ResourcesServerTool(self, str(s["name"]), str(s.get("description", "")),
                                               s.get("parameters"))
                           for s in specs if s.get("type", "function") == "function"]
        declared = {t.name for t in out}
        out += [McpServerTool(self, t.name, t.description or "", t.input_schema)
                for t in self.mcp_tools if t.name not in declared]
        return out

    def seed_body(self, task: Task, session: _Session) -> dict[str, Any]:
        """What ``/seed_session`` gets: a resources-session request, or the legacy row."""
        if self.session_protocol == "legacy":
            return task.metadata
        task_data = {k: v for k, v in task.metadata.items() if k != "responses_create_params"}
        return {"resources_session_id": session.resources_session_id,
                "episode_id": session.episode_id,
                "task_id": {"taskset": self.taskset, "task_id": task.task_id},
                "task_data": task_data}

    async def setup(self, ctx: ToolContext) -> str | None:
        session = _Session.new(ctx.task.task_id)
        ctx.state[_SESSION] = session  # before the seed: the close must know it either way
        status, text, _ = await asyncio.to_thread(
            post_json, _opener(ctx), f"{self.base_url}/seed_session",
            self.seed_body(ctx.task, session), self.timeout_s)
        if status >= 400:
            raise ResourcesServerError(f"/seed_session answered HTTP {status}: {text[:300]}")
        answer = parse_seed_answer(text)
        if (self.session_protocol == "resources_session"
                and answer.resources_session_id != session.resources_session_id):
            raise ResourcesServerError(
                "/seed_session did not take a resources-session seed (it answered "
                f"resources_session_id={answer.resources_session_id!r}, not "
                f"{session.resources_session_id!r}); a server that predates NeMo Gym's "
                "resources sessions needs session_protocol='legacy'")
        session.mcp = answer.mcp_access
        return None

    def response_object(self, ctx: ToolContext, final_message: str | None) -> dict[str, Any]:
        """The episode as an OpenAI Responses-API response (what ``/verify`` expects)."""
        output: list[dict[str, Any]] = []
        for record in ctx.history:
            output.append({"type": "function_call", "id": f"fc_{record.call_id}",
                           "call_id": record.call_id, "name": record.name,
                           "arguments": json.dumps(record.arguments), "status": "completed"})
            output.append({"type": "function_call_output", "call_id": record.call_id,
                           "output": record.result.observation()})
        text = final_message if final_message is not None else ctx.final_answer
        if text is not None:
            output.append({"type": "message", "id": "msg_final", "role": "assistant",
                           "status": "completed",
                           "content": [{"type": "output_text", "text": text, "annotations": []}]})
        params = ctx.task.metadata["responses_create_params"]
        return {"id": f"resp_{ctx.task.task_id}", "object": "response", "created_at": 0,
                "model": self.model, "output": output, "parallel_tool_calls": False,
                "tool_choice": "auto", "tools": params.get("tools") or []}

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        # The verify body stays the row plus the response in both protocols: it is what
        # the servers' verify models take (the session is the episode's cookie).
        body = {**ctx.task.metadata, "response": self.response_object(ctx, final_message)}
        status, text, _ = await asyncio.to_thread(post_json, _opener(ctx),
                                                  f"{self.base_url}/verify", body, self.timeout_s)
        if status >= 400:
            raise ResourcesServerError(f"/verify answered HTTP {status}: {text[:300]}")
        answer = parse_verify_answer(text)
        if answer.masked:
            raise MaskedSampleError(answer.kind, answer.reason)
        detail = "verified by the resources server"
        if answer.kind is not None or answer.reason is not None:
            detail += (f"; degraded but valid: failure_kind={answer.kind!r}, "
                       f"failure_reason={clip(answer.reason or '', 500)!r}")
        return RewardResult(answer.reward, answer.metrics(), detail)

    async def teardown(self, ctx: ToolContext) -> None:
        """``/close_session`` once for the episode's session (see the module docstring)."""
        session = ctx.state.pop(_SESSION, None)
        if not isinstance(session, _Session):
            return
        body = {"resources_session_id": session.resources_session_id,
                "episode_id": session.episode_id}
        try:
            status, text, _ = await asyncio.to_thread(
                post_json, _opener(ctx), f"{self.base_url}/close_session", body, self.timeout_s)
        except ResourcesServerError as e:
            status, text = 0, str(e)
        if status == 0 or (status >= 400 and status not in _NO_CLOSE_ROUTE):
            # Logged, not raised: a failed close must neither hide how the episode ended
            # (a seed that failed, a score) nor undo a scored trajectory; the server's own
            # idle reaping is the backstop for the session it leaves behind.
            log.warning("task %s: /close_session of %s failed (HTTP %s): %s", ctx.task.task_id,
                        session.resources_session_id, status or "none", text[:300])

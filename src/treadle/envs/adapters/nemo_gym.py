"""An adapter for NeMo Gym resources servers: their tasks, tools and verifier as a suite.

A NeMo Gym resources server is an HTTP app with ``POST /seed_session`` (start an
episode's state), one ``POST /<tool name>`` endpoint per tool (JSON arguments in,
JSON out) and ``POST /verify`` (the episode's response in, ``{"reward": ...}``
out). Episode state is keyed by the session cookie the server sets, so each
episode here has its own cookie jar.

Task format: NeMo Gym's dataset rows, unchanged::

    {"responses_create_params": {"input": [{"role": "user", "content": "..."}],
                                 "tools": [{"type": "function", "name": "get_weather",
                                            "description": "...", "parameters": {...}}]},
     "expected_answer": "...", "id": "optional"}

``responses_create_params.input`` (messages or a string) becomes the task prompt;
``tools`` (Responses-API function tools) become the episode's tools, in the
chat-completions format. Every other field is the server's (verifier data) and is
sent back untouched with ``/seed_session`` and ``/verify``. ``id`` (optional) is
the task id; rows without one get a stable hash id.

Per episode: `setup` posts the row to ``/seed_session``; each tool call posts its
arguments to ``/<name>`` and shows the response body to the model (an HTTP error
status sets `error`: the server refused the arguments); `reward` posts the row
plus ``response``, a Responses-API object built from the episode (one
``function_call`` and ``function_call_output`` per tool call, then the final
assistant message), and returns the server's ``reward``.

Infrastructure failures (server unreachable, timeouts, a ``/seed_session`` or
``/verify`` that fails or returns no numeric reward) raise `ResourcesServerError`:
no reward is invented. Blocking HTTP runs in a worker thread (stdlib ``urllib``),
never on the event loop. Not supported: the newer ``/close_session`` protocol and
MCP tool exposure.
"""

from __future__ import annotations

import asyncio
import http.cookiejar
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from treadle.envs.base import RewardResult, Suite
from treadle.envs.errors import EnvConfigError, ResourcesServerError, TaskFormatError
from treadle.envs.records import rng_for, stable_id
from treadle.envs.tools.base import DEFAULT_MAX_OUTPUT_CHARS, Tool, ToolContext, ToolResult, clip
from treadle.types import Task

_OPENER = "nemo_gym.opener"  # ToolContext.state key of the episode's cookie-keeping opener
MAX_RESPONSE_BYTES = 4 * 1024 * 1024


def _post(opener: urllib.request.OpenerDirector, url: str, body: Any,
          timeout_s: float) -> tuple[int, str]:
    """(status, body text) of one JSON POST; ResourcesServerError if no response came."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return response.status, response.read(MAX_RESPONSE_BYTES).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(MAX_RESPONSE_BYTES).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ResourcesServerError(f"POST {url} failed: {e}") from e


def _opener(ctx: ToolContext) -> urllib.request.OpenerDirector:
    opener = ctx.state.get(_OPENER)
    if opener is None:  # one cookie jar per episode: the server keys sessions by cookie
        opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        ctx.state[_OPENER] = opener
    return opener


class ResourcesServerTool(Tool):
    """One tool endpoint of a resources server."""

    def __init__(self, suite: NemoGymSuite, spec: Mapping[str, Any]) -> None:
        self.suite = suite
        self._name = str(spec["name"])
        self._description = str(spec.get("description", ""))
        self._parameters = dict(spec.get("parameters") or {"type": "object", "properties": {}})

    @property
    def name(self) -> str:
        return self._name

    @property
    def description(self) -> str:
        return self._description

    @property
    def parameters(self) -> dict[str, Any]:
        return self._parameters

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        status, text = await asyncio.to_thread(
            _post, _opener(ctx), f"{self.suite.base_url}/{self._name}", arguments,
            self.suite.timeout_s)
        output = clip(text, self.suite.max_output_chars)
        if status >= 400:
            return ToolResult(output=output, error=f"the tool server answered HTTP {status}")
        return ToolResult(output=output)


class NemoGymSuite(Suite):
    """Tasks of one resources server; see the module docstring."""

    name = "nemo_gym"
    file_options = ("rows_path",)

    def __init__(self, base_url: str, *, rows: Sequence[Mapping[str, Any]] | None = None,
                 rows_path: str | Path | None = None, timeout_s: float = 60.0,
                 model: str = "treadle", max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise EnvConfigError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.model = model
        self.max_output_chars = max_output_chars
        self._rows: list[Task] = [self.task_from_record(r) for r in rows or ()]
        if rows_path is not None:
            self._rows += self.load_tasks(rows_path)

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
        prompt = params["input"]
        if not isinstance(prompt, str | list):
            raise TaskFormatError("'responses_create_params.input' must be a string or a "
                                  "list of messages")
        for tool in params.get("tools") or []:
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise TaskFormatError("each of 'responses_create_params.tools' needs a 'name'")
        row = json.loads(json.dumps(dict(record)))  # a private deep copy, JSON-clean
        task_id = row.pop("id", None)
        if task_id is None:
            task_id = stable_id("nemo", row)
        elif not isinstance(task_id, str):
            raise TaskFormatError("field 'id' must be a string")
        prompt_copy: str | list[dict[str, Any]] = json.loads(json.dumps(prompt))
        return Task(task_id=task_id, prompt=prompt_copy, suite=self.name, metadata=row)

    def tools(self, task: Task) -> list[Tool]:
        specs = task.metadata["responses_create_params"].get("tools") or []
        return [ResourcesServerTool(self, s) for s in specs if s.get("type", "function") ==
                "function"]

    async def setup(self, ctx: ToolContext) -> str | None:
        status, text = await asyncio.to_thread(
            _post, _opener(ctx), f"{self.base_url}/seed_session", ctx.task.metadata,
            self.timeout_s)
        if status >= 400:
            raise ResourcesServerError(f"/seed_session answered HTTP {status}: {text[:300]}")
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
        body = {**ctx.task.metadata, "response": self.response_object(ctx, final_message)}
        status, text = await asyncio.to_thread(_post, _opener(ctx), f"{self.base_url}/verify",
                                               body, self.timeout_s)
        if status >= 400:
            raise ResourcesServerError(f"/verify answered HTTP {status}: {text[:300]}")
        try:
            answer = json.loads(text)
            reward = answer["reward"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ResourcesServerError(f"/verify returned no reward: {text[:300]}") from None
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ResourcesServerError(f"/verify returned a non-numeric reward {reward!r}")
        metrics = {k: float(v) for k, v in answer.items()
                   if k != "reward" and isinstance(v, int | float) and not isinstance(v, bool)}
        return RewardResult(float(reward), metrics, "verified by the resources server")


"""NeMo Gym's wire formats, as the adapter (`treadle.envs.adapters.nemo_gym`) speaks them.

Field names are NeMo Gym's own (its ``nemo_gym/base_resources_server.py``,
``nemo_gym/episode_types.py``, ``nemo_gym/judge.py`` and
``nemo_gym/mcp_auto_exposure.py``); what is parsed here is validated by pydantic,
and anything malformed is a `ResourcesServerError` (the server failed, not the
model) or, for a dataset row, a `TaskFormatError`.

- `post_json`: one blocking JSON POST (callers run it in a worker thread).
- `SeedAnswer`, `VerifyAnswer`, `McpAccess`: what ``/seed_session`` and
  ``/verify`` answer.
- `list_mcp_tools`, `call_mcp_tool`: the MCP endpoint a resources server serves
  when it exposes its tools over MCP (JSON-RPC over streamable HTTP, stateless).
- `prompt_messages`: a row's ``responses_create_params.input`` as chat messages
  in the roles treadle's chat format renders.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from treadle.envs.errors import ResourcesServerError, TaskFormatError

MAX_RESPONSE_BYTES = 4 * 1024 * 1024
MCP_PATH = "/mcp"  # where an MCP-exposing server mounts its endpoint
SESSION_TOKEN_HEADER = "X-NeMo-Gym-Session-Token"  # the per-rollout MCP session token
# The streamable-HTTP transport answers 406 unless the client accepts both.
_MCP_HEADERS = {"Accept": "application/json, text/event-stream"}
_MAX_TOOL_PAGES = 20  # tools/list pages followed before giving up on a server's cursor


def post_json(opener: urllib.request.OpenerDirector, url: str, body: Any, timeout_s: float,
              headers: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """(status, body text, content type) of one JSON POST; ResourcesServerError if no
    response came (unreachable, refused, timed out)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with opener.open(request, timeout=timeout_s) as response:
            text = response.read(MAX_RESPONSE_BYTES).decode("utf-8", "replace")
            return response.status, text, response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        text = e.read(MAX_RESPONSE_BYTES).decode("utf-8", "replace")
        return e.code, text, e.headers.get("Content-Type", "")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ResourcesServerError(f"POST {url} failed: {e}") from e


class McpAccess(BaseModel):
    """How one rollout reaches the server's MCP endpoint (NeMo Gym's MCPServerMetadata)."""

    model_config = ConfigDict(extra="ignore")

    server_name: str
    url_path: str = MCP_PATH
    transport: str = "http"
    headers: dict[str, str] = Field(default_factory=dict)


class SeedAnswer(BaseModel):
    """A ``/seed_session`` answer. A server that took a resources-session seed echoes
    ``resources_session_id`` and may hand out MCP access as ``resources_tools``; a
    legacy seed answers ``{}``, or ``{"mcp": ...}`` when the server exposes MCP."""

    model_config = ConfigDict(extra="ignore")

    resources_session_id: str | None = None
    resources_tools: McpAccess | None = None
    mcp: McpAccess | None = None

    @property
    def mcp_access(self) -> McpAccess | None:
        return self.resources_tools or self.mcp


class VerifyAnswer(BaseModel):
    """A ``/verify`` answer (NeMo Gym's BaseVerifyResponse plus the server's fields).

    ``mask_sample`` says the reward measures the environment's failure, not the
    policy (a judge that could not be reached, a lost session). ``failure_kind``
    (groupable) and ``failure_reason`` (free text) describe a failure whether or not
    it masks the sample. Servers older than those fields mark a failed judge with
    ``_ng_failure_class`` / ``_ng_failure_judge_error`` next to a placeholder reward
    0.0, and some agents put the flag under ``instance_config.mask_sample``.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    reward: Annotated[float, Field(strict=True, allow_inf_nan=False)]
    mask_sample: StrictBool = False
    failure_kind: str | None = None
    failure_reason: str | None = None
    legacy_failure_class: str | None = Field(default=None, alias="_ng_failure_class")
    legacy_judge_error: str | None = Field(default=None, alias="_ng_failure_judge_error")
    instance_config: dict[str, Any] | None = None

    @property
    def masked(self) -> bool:
        """True when the reward is no measurement of the policy (see the class docstring)."""
        return (self.mask_sample or self.legacy_failure_class is not None
                or (self.instance_config or {}).get("mask_sample") is True)

    @property
    def kind(self) -> str | None:
        return self.failure_kind or self.legacy_failure_class

    @property
    def reason(self) -> str | None:
        return self.failure_reason or self.legacy_judge_error

    def metrics(self) -> dict[str, float]:
        """The answer's other top-level numbers (the server's reward parts)."""
        return {k: float(v) for k, v in (self.model_extra or {}).items()
                if isinstance(v, int | float) and not isinstance(v, bool)}


def parse_verify_answer(text: str) -> VerifyAnswer:
    try:
        return VerifyAnswer.model_validate_json(text)
    except ValidationError as e:
        problem = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                            for err in e.errors()[:3])
        raise ResourcesServerError(f"/verify answered no usable reward ({problem}): "
                                   f"{text[:300]}") from None


def parse_seed_answer(text: str) -> SeedAnswer:
    """The seed answer; an empty or non-object body is a legacy server's empty answer."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        value = {}  # legacy seeds answer anything; only the fields above are read
    try:
        return SeedAnswer.model_validate(value if isinstance(value, dict) else {})
    except ValidationError as e:
        raise ResourcesServerError(f"/seed_session answered malformed MCP access: "
                                   f"{e.errors()[0]['msg']}") from None


# -- MCP (JSON-RPC 2.0 over streamable HTTP; the server runs it stateless) -------------


class McpTool(BaseModel):
    """One entry of a ``tools/list`` result."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"},
                                         alias="inputSchema")


def mcp_request(url: str, method: str, params: dict[str, Any], *, request_id: int,
                headers: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
    """The ``result`` of one JSON-RPC call; ResourcesServerError for an HTTP error, a
    JSON-RPC error or an answer that is not JSON-RPC."""
    body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    try:
        status, text, content_type = post_json(urllib.request.build_opener(), url, body,
                                               timeout_s, {**_MCP_HEADERS, **headers})
    except ResourcesServerError as e:
        raise ResourcesServerError(f"MCP {method}: {e}") from e
    if status >= 400:
        raise ResourcesServerError(f"MCP {method} at {url} answered HTTP {status}: {text[:300]}")
    message = _jsonrpc_message(text, content_type, request_id)
    if message is None:
        raise ResourcesServerError(f"MCP {method} at {url} answered no JSON-RPC reply: "
                                   f"{text[:300]}")
    if "error" in message:
        raise ResourcesServerError(f"MCP {method} at {url} failed: {message['error']!r:.300}")
    result = message.get("result")
    if not isinstance(result, dict):
        raise ResourcesServerError(f"MCP {method} at {url} answered no result: {text[:300]}")
    return result


def _jsonrpc_message(text: str, content_type: str, request_id: int) -> dict[str, Any] | None:
    """The reply to `request_id` in a JSON body or in an event stream's ``data:`` lines."""
    if "text/event-stream" in content_type:
        candidates = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    else:
        candidates = [text]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and value.get("id") == request_id:
            return value
    return None


def list_mcp_tools(url: str, timeout_s: float,
                   headers: Mapping[str, str] | None = None) -> list[McpTool]:
    """Every tool ``tools/list`` advertises at `url`, following ``nextCursor``."""
    tools: list[McpTool] = []
    cursor: str | None = None
    for page in range(_MAX_TOOL_PAGES):
        params = {} if cursor is None else {"cursor": cursor}
        result = mcp_request(url, "tools/list", params, request_id=page + 1,
                             headers=headers or {}, timeout_s=timeout_s)
        try:
            tools += [McpTool.model_validate(t) for t in result.get("tools") or []]
        except ValidationError as e:
            raise ResourcesServerError(f"MCP tools/list at {url} answered a malformed tool: "
                                       f"{e.errors()[0]['msg']}") from None
        cursor = result.get("nextCursor")
        if not isinstance(cursor, str) or not cursor:
            return tools
    raise ResourcesServerError(f"MCP tools/list at {url} kept paging past {_MAX_TOOL_PAGES} pages")


def call_mcp_tool(url: str, name: str, arguments: dict[str, Any], *, headers: Mapping[str, str],
                  timeout_s: float) -> tuple[str, bool]:
    """(the call's text output, whether the tool reported an error). A tool's own error
    (bad arguments, a refused call) is the model's to see; anything else raises."""
    result = mcp_request(url, "tools/call", {"name": name, "arguments": arguments},
                         request_id=1, headers=headers, timeout_s=timeout_s)
    texts = [c.get("text", "") for c in result.get("content") or []
             if isinstance(c, dict) and c.get("type") == "text"]
    if not texts and "structuredContent" in result:
        texts = [json.dumps(result["structuredContent"])]
    return "\n".join(str(t) for t in texts), result.get("isError") is True


# -- prompts ----------------------------------------------------------------------------

# Responses-API input roles and what treadle's Qwen/Hermes format renders them as:
# that template has no developer turn, so a developer message is a system message
# (what NeMo Gym's vLLM model server does with replace_developer_role_with_system).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def prompt_messages(value: Any) -> str | list[dict[str, str]]:
    """``responses_create_params.input`` as treadle's prompt: a string unchanged, or
    {role, content} messages in the roles system/user/assistant. Leading system and
    developer messages become one system message (the format renders one, first);
    TaskFormatError for what it cannot render: a system or developer message after
    the conversation started, non-text content, or items that are not messages."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise TaskFormatError("'responses_create_params.input' must be a string or a "
                              "non-empty list of messages")
    system: list[str] = []
    out: list[dict[str, str]] = []
    for i, item in enumerate(value):
        where = f"'responses_create_params.input[{i}]'"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise TaskFormatError(f"{where} must be a message (type 'message'); other input "
                                  "items (function calls, reasoning) are not supported")
        role = _ROLES.get(str(item.get("role")))
        if role is None:
            raise TaskFormatError(f"{where}: role must be one of {', '.join(_ROLES)}, got "
                                  f"{item.get('role')!r}")
        text = _text(item.get("content"), where)
        if role != "system":
            out.append({"role": role, "content": text})
        elif out:
            raise TaskFormatError(f"{where}: a {item['role']} message after the conversation "
                                  "started cannot be rendered (only one system turn, first)")
        else:
            system.append(text)
    if not out:
        raise TaskFormatError("'responses_create_params.input' has no user or assistant message")
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise TaskFormatError(f"{where}: content must be text (a string or input_text parts)")


# -- identities -------------------------------------------------------------------------

_NOT_ID = re.compile(r"[^A-Za-z0-9._-]+")


def rollout_id(task_id: str, unique: str) -> str:
    """An EpisodeId.rollout_id for one episode of `task_id`: NeMo Gym's alphabet
    (``[A-Za-z0-9][A-Za-z0-9._-]*``), and never ending in its reserved ``-a<N>``
    attempt suffix (the tail is ``.<unique>``)."""
    stem = _NOT_ID.sub("_", task_id).lstrip("._-")[:80] or "task"
    return f"{stem}.{unique}"

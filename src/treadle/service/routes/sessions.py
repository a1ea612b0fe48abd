"""`/v1/sessions`: sessions a harness calls through the OpenAI-compatible gateway.

A session belongs to the key that made it: a trainer's session is seen and ended by
that run's keys (and the admin's), and by nobody else (a 404, as for an unknown
one). Each gets a key of its own (`api_key`), which opens its OpenAI routes (and
the tools served to it) only; the session's end revokes it. A session treadle made
for a harness job is ended by treadle alone (409).

A harness job's session whose task needs a sandbox is served its episode's tools
(`gateway.tools`, the harness's ``TREADLE_TOOLS_URL``): ``GET .../tools`` lists
their specs (OpenAI's function format), ``POST .../tools/{name}`` with the
arguments as a JSON body runs one in the task's sandbox and answers its result
(`ToolReply`); bad arguments are the tool's own error result, an unknown tool a
404. Opened by the session's key (`SessionToolsDep`: `DoorDep`'s callers)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request

from treadle.gateway.errors import SessionBusy
from treadle.service import strict_json
from treadle.service.deps import CallerDep, OwnedSessionDep, ServiceDep, SessionToolsDep
from treadle.service.errors import RequestRefused
from treadle.service.keys import owner_of, sees
from treadle.service.replies import documented
from treadle.service.schemas import (
    SessionEndRequest,
    SessionOpened,
    SessionRequest,
    SessionView,
)
from treadle.service.strict_json import StrictJSONRoute
from treadle.service.tool_schemas import ToolReply
from treadle.store.errors import NotFound

router = APIRouter(prefix="/v1/sessions", route_class=StrictJSONRoute, tags=["sessions"])


@router.post("", status_code=201, responses=documented(400, 404, 409, 422))
async def create(body: SessionRequest, request: Request, caller: CallerDep,
                 service: ServiceDep) -> SessionOpened:
    if body.job_id is not None:
        try:
            owner = (await service.store.job(body.job_id)).owner
        except NotFound:
            owner = None
        if not sees(caller, owner):  # another run's job reads as an unknown one
            raise RequestRefused(f"job_id: no job {body.job_id!r}")
    if body.parent_session_id is not None:
        service.keys.owned_session(caller, body.parent_session_id)
    base = service.config.public_url or str(request.base_url)
    created = await service.gateway.create(body, base, owner=owner_of(caller))
    key = service.keys.grant_session(created.session_id, owner_of(caller))
    service.gateway.opened(created.session_id, owner_of(caller), key)
    return SessionOpened(**created.model_dump(), api_key=key)


@router.get("/{session_id}", responses=documented(404))
async def session(session_id: str, _owned: OwnedSessionDep,
                  service: ServiceDep) -> SessionView:
    return service.gateway.view(session_id)


@router.post("/{session_id}/end", responses=documented(404, 409, 422))
async def end(session_id: str, body: SessionEndRequest, owned: OwnedSessionDep,
              service: ServiceDep) -> SessionView:
    if owned is not None and owned.treadle_ends:
        raise SessionBusy(f"session {session_id} belongs to a harness run, which ends it",
                          param="session_id")
    view = await service.gateway.end(session_id, body)
    service.keys.sessions.revoke(session_id)
    return view


_ARGUMENTS = {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "description": "the tool's arguments, as its spec's parameters "
                                     "say; what the tool refuses is its error result"}}}}


@router.get("/{session_id}/tools", responses=documented(400, 404))
async def tools(tools: SessionToolsDep) -> list[dict[str, Any]]:
    """The session's tools in OpenAI's function format (`Episode.tool_specs`)."""
    return tools.specs


@router.post("/{session_id}/tools/{name}", openapi_extra={"requestBody": _ARGUMENTS},
             responses=documented(400, 404, 409))
async def call_tool(name: str, request: Request, tools: SessionToolsDep) -> ToolReply:
    """Run one tool in the session's sandbox; its result, an error result included."""
    return ToolReply.of(await tools.call(name, tool_arguments(await request.body())))


def tool_arguments(raw: bytes) -> Mapping[str, Any] | str:
    """A tool call's body as `Episode.call` takes it: the object it holds, else its text
    (which the episode answers as the tool's error: not JSON, not an object). A body
    only Python's lenient parser reads (NaN, a lone surrogate) is no JSON object to
    the tool either: it is given as a JSON string, which no record refuses."""
    try:
        value = strict_json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        text = raw.decode("utf-8", "replace")
        try:
            json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
            return text
        return json.dumps(text)
    return value if isinstance(value, dict) else raw.decode("utf-8")

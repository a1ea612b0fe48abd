"""`/v1/sessions/{id}/openai/v1`: the OpenAI-compatible door of one session.

A harness sets this as its OpenAI base URL (and the session's key, `api_key` of
`POST /v1/sessions`, as its API key: it opens these two routes of this session and
nothing else). Every error is OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}`` (`treadle.gateway.wire`), so that the harness's SDK raises the error it
knows: 400 for what the gateway cannot honour, 404 for an unknown session, 409 for
a call while another runs, 503 when the engines fail.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.errors import InputError, TreadleError
from treadle.gateway import chat_request, wire
from treadle.gateway.errors import GatewayError, InvalidRequest
from treadle.service import strict_json
from treadle.service.deps import DoorDep, ServiceDep
from treadle.service.keys import Admin, SessionHolder, Trainer
from treadle.service.state import Service

router = APIRouter(prefix="/v1/sessions/{session_id}/openai/v1", tags=["gateway"])

_NULLABLE_TEXT = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": _NULLABLE_TEXT, "code": _NULLABLE_TEXT}}}}
_SERVICE_ERROR = {"type": "object", "required": ["detail"]}  # the gate's 401/403/408/413/503


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"description": _ERROR_TEXT[code], "content": {"application/json": {
        "schema": {"anyOf": [_OPENAI_ERROR, _SERVICE_ERROR]}}}} for code in codes}


_ERROR_TEXT = {
    400: "what the gateway cannot honour, a session ended or at a limit (OpenAI's shape)",
    404: "no such session (OpenAI's shape)",
    409: "another call of the session is running (OpenAI's shape)",
    503: "the engines failed the call, or the service is busy",
}
# The body's schema is generated from the model `gateway.wire.parse_chat` validates
# every body with (`gateway.chat_request`): what it declares is what is served.
_CHAT_BODY = {"required": True, "content": {"application/json": {
    "schema": chat_request.openapi_schema()}}}
_CHAT_REPLY: dict[int | str, dict[str, Any]] = {200: {
    "description": "a chat.completion, or its chunks as server-sent events",
    "content": {"application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {}}}}}  # chunks, then [DONE]


@router.post("/chat/completions", response_model=None,
             openapi_extra={"requestBody": _CHAT_BODY},
             responses={**_CHAT_REPLY, **_errors(400, 404, 409, 503)})
async def chat_completions(session_id: str, request: Request, _door: DoorDep,
                           service: ServiceDep) -> Response:
    return await answer(service, session_id, await request.body())


async def answer(service: Service, session_id: str, raw: bytes) -> Response:
    """The reply to a chat call of `session_id` whose body is `raw`, the caller's
    scope already checked: the completion, its chunks, or an error in OpenAI's shape."""
    try:
        try:
            body = strict_json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"the body is not JSON: {str(e)[:200]}") from None
        call, options = wire.parse_chat(body)
        result = await service.gateway.call(session_id, call, body)
    except GatewayError as e:
        return _error(e)
    except InputError as e:  # a service without a tokenizer, a refused field
        return _error(InvalidRequest(str(e)))
    except TreadleError as e:  # the service itself: busy, closing
        return _error(GatewayError(str(e)), 503)
    call_id = f"chatcmpl-{session_id}-{result.turn}"
    spell = service.gateway.token_text
    if options.stream:
        return StreamingResponse(wire.chunks(result, options, call_id, spell),
                                 media_type="text/event-stream")
    body_out = json.dumps(wire.completion(result, options, call_id, spell),
                          ensure_ascii=False).encode()
    return Response(body_out, media_type="application/json")


@router.get("/models", response_model=None,
            responses={200: {"description": "the served model",
                             "content": {"application/json": {"schema": {"type": "object"}}}},
                       **_errors(400, 404)})
async def models(session_id: str, _door: DoorDep, service: ServiceDep) -> Response:
    try:
        service.gateway.session(session_id)
    except GatewayError as e:
        return _error(e)
    except InputError as e:
        return _error(InvalidRequest(str(e)))
    return JSONResponse(wire.models_list(service.config.served_model))


def _error(error: GatewayError, status: int | None = None) -> JSONResponse:
    return JSONResponse(wire.error_body(error), status or error.status)


class ChatDoor:
    """ASGI middleware (inside `limits.RequestGate`, which has checked the key, taken
    a slot and bounds the body): answers `chat_completions` without FastAPI's routing
    and dependency solving, a share of the service's CPU on every call of every
    harness (benchmarks/gateway.json). The answer is `answer`'s, as the route's.

    Only the plain case is taken here: a POST on the route's path with one ASCII
    bearer header whose key opens that session (its own key; the admin's or its
    owner's trainer's, for a session they see). Anything else goes on to the app, and
    so does a body whose reading failed, its failure replayed to the route's reading,
    so that every refusal is the route's own."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service
        (self.route,) = (r for r in router.routes
                         if isinstance(r, APIRoute) and r.endpoint is chat_completions)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        match = self.route.path_regex.match(scope["path"])
        if match is None or not self._opens(scope, session_id := match["session_id"]):
            await self.app(scope, receive, send)
            return
        try:
            raw = await Request(scope, receive).body()
        except Exception as e:  # a limit, a disconnect: the route reads it and answers
            await self.app(scope, _failing(e), send)
            return
        scope["route"] = self.route  # the gate's latency histogram names it
        scope["path_params"] = {"session_id": session_id}
        reply = await answer(self.service, session_id, raw)
        await reply(scope, _replaying(raw, receive), send)

    def _opens(self, scope: Scope, session_id: str) -> bool:
        """Whether the request's key opens `session_id`'s door as `deps.get_door` lets
        it (False for whatever the route answers with an error)."""
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given) > 1 or (given and not given[0].isascii()):
            return False
        keys = self.service.keys
        match keys.principal(given[0] if given else None):
            case SessionHolder(session_id=mine):
                return mine == session_id
            case Admin() | Trainer() as caller:
                try:
                    keys.owned_session(caller, session_id)
                except TreadleError:
                    return False
                return True
            case _:
                return False


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app after `body` was read: the body, then `receive` itself
    (a stream waits on it for the client to hang up)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _failing(error: Exception) -> Receive:
    """`receive` raising `error`, what reading the body raised."""

    async def fail() -> Message:
        raise error

    return fail

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

from treadle.errors import InputError, TreadleError
from treadle.gateway import chat_request, wire
from treadle.gateway.errors import GatewayError, InvalidRequest
from treadle.service import strict_json
from treadle.service.deps import DoorDep, ServiceDep

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
    try:
        try:
            body = strict_json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"the body is not JSON: {str(e)[:200]}") from None
        call, options = wire.parse_chat(body)
        result = await service.gateway.call(session_id, call)
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

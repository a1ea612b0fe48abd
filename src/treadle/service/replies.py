"""Error answers: one table from exception class to HTTP status, and the handlers.

Every error body is ``{"detail": ...}`` (`schemas.ErrorReply`): a message, or for a
422 one ``{"loc", "msg", "type"}`` entry per bad field. What an error echoes of the
request is bounded (`MAX_FIELD_ERRORS` entries, `MAX_MESSAGE_CHARS` a message, no
``input``): a huge bad field must not come back in the answer, nor stall the loop
serialising it. No message shows an engine's address (`engines.errors.public_text`:
an engine's error names it for the logs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Scope

from treadle.engines.errors import public_text
from treadle.errors import ServiceBusy
from treadle.gateway import wire
from treadle.gateway.errors import GatewayError
from treadle.service.errors import Forbidden, RequestRefused
from treadle.service.schemas import ErrorReply
from treadle.service.versions import PolicyMismatch
from treadle.store.errors import NotFound, StoreConflict

MAX_FIELD_ERRORS = 32  # entries of a 422's detail
MAX_MESSAGE_CHARS = 400  # characters of one message
RETRY_AFTER_S = 5  # what a 503 for a full queue tells the client to wait

# The status of each error class treadle raises on purpose that reaches a route.
# RequestRefused (a field-level 422) and RequestValidationError have their own shape.
STATUS: dict[type[Exception], int] = {
    Forbidden: 403,
    NotFound: 404,
    StoreConflict: 409,
    PolicyMismatch: 409,
    ServiceBusy: 503,
}

_TEXT = {
    400: "the session has ended",
    401: "missing, wrong or expired bearer key",
    403: "the key's scope does not cover this request (docs/security.md)",
    404: "no such job, engine or session",
    408: "the request body did not arrive in time",
    409: "the job id is taken, the session is busy or taken, or the engines serve "
         "weights the job is not for",
    413: "request body over the service's max_body_bytes",
    422: "bad input: one entry per bad field",
    503: "too many requests at once, or too many trajectories queued: retry after "
         "Retry-After seconds",
}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error codes."""
    return {code: {"model": ErrorReply, "description": _TEXT[code]} for code in codes}


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` as an error body may carry it: no engine address, at most `limit`
    characters."""
    text = public_text(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def field_errors(entries: Sequence[dict[str, Any]]) -> JSONResponse:
    """A 422 of these `{"loc", "msg", "type"}` entries, bounded."""
    detail = [{"loc": [p if isinstance(p, int) else clip(str(p), 128) for p in e["loc"]],
               "msg": clip(str(e["msg"])), "type": str(e["type"])}
              for e in entries[:MAX_FIELD_ERRORS]]
    return JSONResponse({"detail": detail}, 422)


def refused(error: RequestRefused) -> JSONResponse:
    """RequestRefused's message is ``dotted.field.path: why``."""
    field, _, msg = str(error).partition(": ")
    return field_errors([{"loc": ["body", *field.split(".")], "msg": msg or field,
                          "type": "value_error"}])


def install(app: FastAPI, routes: Sequence[BaseRoute]) -> None:
    """The handlers of the table and of FastAPI's own errors, on `app`; `routes` are
    every route the app serves (for the Allow header of a 405)."""
    for cls, status in STATUS.items():
        app.add_exception_handler(cls, _status_handler(status))
    app.add_exception_handler(RequestRefused, _refused)
    app.add_exception_handler(GatewayError, _gateway)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_handler(list(routes)))


def _status_handler(status: int) -> Any:
    async def handle(_r: Request, e: Exception) -> Response:
        headers = {"retry-after": str(RETRY_AFTER_S)} if status == 503 else None
        return JSONResponse({"detail": clip(str(e))}, status, headers=headers)
    return handle


async def _gateway(request: Request, e: Exception) -> Response:
    # A session's errors: the status each class carries, in OpenAI's shape on a
    # session's OpenAI routes (what their scope check raises) and as every other
    # error on the service's own routes.
    assert isinstance(e, GatewayError)
    if "/openai/v1/" in request.url.path:
        return JSONResponse(wire.error_body(e), e.status)
    return JSONResponse({"detail": clip(str(e))}, e.status)


async def _refused(_r: Request, e: Exception) -> Response:
    assert isinstance(e, RequestRefused)
    return refused(e)


async def _invalid(_r: Request, e: Exception) -> Response:
    assert isinstance(e, RequestValidationError)
    # FastAPI reports an unparsable body at ("body", offset); the body as a whole is
    # what is wrong, and the offset of a 60 MiB body is noise.
    entries = [{"loc": ("body",), "type": "json_invalid",
                "msg": f"the body is not JSON: {(x.get('ctx') or {}).get('error', x['msg'])}"}
               if x.get("type") == "json_invalid" else x for x in e.errors()]
    return field_errors(entries)


def _http_handler(routes: list[BaseRoute]) -> Any:
    async def handle(request: Request, e: Exception) -> Response:
        assert isinstance(e, StarletteHTTPException)
        if e.status_code == 400:
            # FastAPI's answer to a body it cannot parse at all (not UTF-8, nested
            # deeper than the JSON parser goes): bad input, so a 422 like the rest.
            return field_errors([{"loc": ["body"], "msg": "the body is not readable JSON",
                                  "type": "json_invalid"}])
        headers = {k: v for k, v in (e.headers or {}).items() if k.lower() != "allow"}
        if e.status_code == 405:
            # Starlette names the methods of the first route on the path only.
            headers["allow"] = ", ".join(_allowed_methods(routes, request.scope))
        return JSONResponse({"detail": e.detail}, e.status_code, headers=headers)
    return handle


def _allowed_methods(routes: list[BaseRoute], scope: Scope) -> list[str]:
    """Every method some route on the request's path answers."""
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, Route) and route.matches(scope)[0] is not Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


__all__ = ["STATUS", "documented", "field_errors", "install", "refused"]

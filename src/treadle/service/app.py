"""The HTTP API (FastAPI): rollouts as a service.

    POST /v1/jobs                        submit a job → 201 {job_id, planned}
    GET  /v1/jobs/{id}                   status, counts by trajectory status, progress
    GET  /v1/jobs/{id}/trajectories      finished trajectories as NDJSON, in completion
                                         order: ?after=SEQ resumes after a sequence
                                         number, ?follow=true waits for the rest
    POST /v1/jobs/{id}/cancel            cancel: unfinished trajectories become aborted
    POST /v1/rollouts                    one trajectory, answered when it ends
    GET  /v1/engines                     the engine pool
    POST /v1/engines                     register a running engine (health-checked)
    POST /v1/engines/{id}/drain          send it nothing more; removed once idle
    DELETE /v1/engines/{id}              remove it now (its turns move elsewhere)
    GET  /v1/weights                     the policy version and whether paused
    POST /v1/weights/pause               hold new engine calls ("wait" or "abort" those
                                         in flight); returns once none is in flight
    POST /v1/weights/resume              the engines serve `policy_version` now; go on
    POST /v1/weights/update              pause, every engine loads `weights_path`, resume
                                         with `policy_version` (vLLM in dev mode)
    GET  /healthz                        liveness (no auth)
    GET  /metrics                        Prometheus text

Each NDJSON line is ``{"seq": n, "trajectory": <record>}`` (the record:
`treadle.store.record`). Every route but `/healthz` and the schema (`/openapi.json`,
`/docs`) needs ``Authorization: Bearer <token>`` when the service has a token (401
otherwise; the schema declares it as an HTTP bearer scheme). A body over
`max_body_bytes` is a 413, whether it declares its length or is sent chunked; more
than `max_requests` requests at once (streams counted apart, up to `max_streams`),
or a job that would queue more than `max_queued` trajectories, a 503 with
Retry-After. Bad input is a 422 whose ``detail`` lists ``{"loc", "msg", "type"}``
per bad field (a body that is not JSON at all: one entry at ``["body"]``); an
unknown job or engine a 404; a job id already taken a 409; a method a route does
not have a 405 whose Allow header lists the ones it has. Every error body is
``{"detail": ...}`` (`schemas.ErrorReply`), and the OpenAPI schema declares each
route's errors. No route runs code: tools run in the service's sandboxes, and only
suites registered in the process can be named.
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from treadle.runtime.driver import EngineSlot
from treadle.served import declared_too_large, limit_body
from treadle.service.errors import RequestRefused, ServiceBusy
from treadle.service.schemas import (
    MAX_INT64,
    EngineRequest,
    EngineView,
    ErrorReply,
    JobCreated,
    JobRequest,
    JobView,
    PauseRequest,
    ResumeRequest,
    RolloutRequest,
    WeightsView,
    WeightUpdateRequest,
)
from treadle.service.state import Service, engine_client
from treadle.store.errors import NotFound, StoreConflict
from treadle.store.jobs import JobInfo


def create_app(service: Service) -> FastAPI:
    """The ASGI app over `service`; its lifespan starts and closes the service."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.close()

    # The schema is served behind the token like every route but /healthz (no docs UI).
    app = FastAPI(title="treadle", version="1", lifespan=lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None,
                  description="Rollouts for agentic RL: jobs of tasks in, token-exact "
                              "trajectories out.")
    auth = Depends(_authorizer(service.config.token))

    @app.get("/openapi.json", dependencies=[auth], include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())
    # The errors every authorised route can answer; routes add their own below.
    common = _errors(*((401,) if service.config.token else ()), 413, 503)

    @app.exception_handler(NotFound)
    async def not_found(_r: Request, e: NotFound) -> Response:
        return JSONResponse({"detail": str(e)}, 404)

    @app.exception_handler(StoreConflict)
    async def conflict(_r: Request, e: StoreConflict) -> Response:
        return JSONResponse({"detail": str(e)}, 409)

    @app.exception_handler(ServiceBusy)
    async def busy(_r: Request, e: ServiceBusy) -> Response:
        return JSONResponse({"detail": str(e)}, 503, headers={"retry-after": "5"})

    @app.exception_handler(RequestRefused)
    async def refused(_r: Request, e: RequestRefused) -> Response:
        field, _, msg = str(e).partition(": ")
        return JSONResponse({"detail": [{"loc": ["body", *field.split(".")], "msg": msg or field,
                                         "type": "value_error"}]}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        if e.status_code == 400:
            # FastAPI's answer to a body it cannot parse at all (not UTF-8, nested
            # deeper than the JSON parser goes): bad input, so a 422 like the rest.
            return JSONResponse({"detail": [{"loc": ["body"], "msg": "the body is not "
                                             "readable JSON", "type": "json_invalid"}]}, 422)
        headers = {k: v for k, v in (e.headers or {}).items() if k.lower() != "allow"}
        if e.status_code == 405:
            # Starlette names the methods of the first route on the path only.
            headers["allow"] = ", ".join(_allowed_methods(app, request.scope))
        return JSONResponse({"detail": e.detail}, e.status_code, headers=headers)

    @app.get("/healthz", include_in_schema=True)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "engines": len(service.runtime.engines()),
                "policy_version": service.runtime.policy_version}

    @app.get("/metrics", dependencies=[auth],
             responses={200: {"content": {"text/plain": {}}}, **common})
    async def metrics() -> PlainTextResponse:
        # A JSON route otherwise, so that its errors are JSON like every other's.
        return PlainTextResponse(service.metrics_text())

    @app.post("/v1/jobs", dependencies=[auth], status_code=201,
              responses={**common, **_errors(409)})
    async def submit(request: JobRequest) -> JobCreated:
        info = await service.rollouts.submit(request)
        return JobCreated(job_id=info.job_id, planned=info.planned)

    @app.get("/v1/jobs/{job_id}", dependencies=[auth], responses={**common, **_errors(404)})
    async def job(job_id: str) -> JobView:
        info, running, queued = await service.rollouts.job(job_id)
        return _job_view(info, running, queued)

    @app.get("/v1/jobs/{job_id}/trajectories", dependencies=[auth],
             response_class=StreamingResponse,
             responses={200: {"content": {"application/x-ndjson": {}},
                              "description": "one JSON object a line"},
                        **common, **_errors(404)})
    async def trajectories(job_id: str, after: int = Query(0, ge=0, le=MAX_INT64),
                           follow: bool = Query(False)) -> StreamingResponse:
        await service.rollouts.job(job_id)  # 404 before the stream starts

        async def lines() -> AsyncIterator[bytes]:
            async for d in service.rollouts.results(job_id, after, follow=follow):
                yield f'{{"seq":{d.seq},"trajectory":{d.record_json}}}\n'.encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/jobs/{job_id}/cancel", dependencies=[auth],
              responses={**common, **_errors(404)})
    async def cancel(job_id: str) -> JobView:
        # Nothing of a cancelled job runs or waits here any more.
        return _job_view(await service.rollouts.cancel(job_id), 0, 0)

    @app.post("/v1/rollouts", dependencies=[auth], responses=common)
    async def rollout(request: RolloutRequest) -> dict[str, Any]:
        return await service.rollouts.rollout(request)

    @app.get("/v1/engines", dependencies=[auth], responses=common)
    async def engines() -> list[EngineView]:
        return [_engine_view(s) for s in service.runtime.engines()]

    @app.post("/v1/engines", dependencies=[auth], status_code=201, responses=common)
    async def register(request: EngineRequest) -> EngineView:
        engine = engine_client(request)
        if not await engine.health():
            await engine.aclose()
            return JSONResponse(  # type: ignore[return-value]
                {"detail": [{"loc": ["body", "url"], "msg": f"no healthy engine at "
                             f"{request.url}", "type": "value_error"}]}, 422)
        eid = service.runtime.register_engine(
            engine, tp=request.tp, max_batch=request.max_batch,
            kv_capacity_tokens=request.kv_capacity_tokens, label=request.url)
        return _engine_view(_slot(service, eid))

    @app.post("/v1/engines/{engine_id}/drain", dependencies=[auth],
              responses={**common, **_errors(404)})
    async def drain(engine_id: str) -> EngineView:
        slot = _slot(service, engine_id)
        service.runtime.drain_engine(engine_id)
        return _engine_view(slot)

    @app.delete("/v1/engines/{engine_id}", dependencies=[auth], status_code=204,
                responses={**common, **_errors(404)})
    async def remove(engine_id: str) -> Response:
        _slot(service, engine_id)
        service.runtime.remove_engine(engine_id, "removed through the API")
        return Response(status_code=204)

    @app.get("/v1/weights", dependencies=[auth], responses=common)
    async def weights() -> WeightsView:
        return service.weights_view()

    @app.post("/v1/weights/pause", dependencies=[auth], responses=common)
    async def pause(request: PauseRequest) -> WeightsView:
        await service.runtime.pause(request.mode)
        return service.weights_view()

    @app.post("/v1/weights/update", dependencies=[auth], responses=common)
    async def update(request: WeightUpdateRequest) -> WeightsView:
        try:
            await service.runtime.update_weights(request.weights_path, request.policy_version,
                                                 request.mode)
        except ValueError as e:
            raise RequestRefused(f"weights_path: {e}") from None
        service.rollouts.policy_version_changed()
        return service.weights_view()

    @app.post("/v1/weights/resume", dependencies=[auth], responses=common)
    async def resume(request: ResumeRequest) -> WeightsView:
        service.runtime.resume(request.policy_version)
        service.rollouts.policy_version_changed()
        return service.weights_view()

    app.add_middleware(_Limits, service=service)
    return app


def _authorizer(token: str | None) -> Callable[..., Awaitable[None]]:
    if token is None:
        async def open_() -> None:
            return None
        return open_
    expected = token.encode()
    bearer = HTTPBearer(auto_error=False, description="the service's token "
                                                      "(treadle serve --token)")

    # A default, not Annotated: the annotation is a string (future import) that FastAPI
    # resolves in the module's namespace, where this local `bearer` is not.
    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
                    ) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, expected):
            raise HTTPException(401, "missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})
    return check


_ERROR_TEXT = {
    401: "missing or wrong bearer token",
    404: "no such job or engine",
    409: "the job id is taken",
    413: "request body over the service's max_body_bytes",
    503: "too many requests at once, or too many trajectories queued: retry after "
         "Retry-After seconds",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error codes."""
    return {code: {"model": ErrorReply, "description": _ERROR_TEXT[code]} for code in codes}


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route on the request's path answers."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.matches(scope)[0] is not Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


def _job_view(info: JobInfo, running: int, queued: int) -> JobView:
    return JobView(job_id=info.job_id, status=info.status.value, reason=info.reason,
                   planned=info.planned, delivered=info.delivered,
                   counts={s.value: n for s, n in info.counts.items()},
                   progress=info.delivered / info.planned if info.planned else 1.0,
                   created_at=info.created_at, started_at=info.started_at,
                   finished_at=info.finished_at, running=running, queued=queued)


def _engine_view(slot: EngineSlot) -> EngineView:
    return EngineView(engine_id=slot.engine_id, label=slot.label, tp=slot.tp,
                      max_batch=slot.max_batch, kv_capacity_tokens=slot.kv_capacity_tokens,
                      calls_in_flight=slot.calls, draining=slot.draining)


def _slot(service: Service, engine_id: str) -> EngineSlot:
    for slot in service.runtime.engines():
        if slot.engine_id == engine_id:
            return slot
    raise NotFound(f"no engine {engine_id!r}")


class _Limits:
    """ASGI middleware: body size, concurrent requests and streams, API latency."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service
        self.requests = 0
        self.streams = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/healthz":
            await self.app(scope, receive, send)
            return
        limits = self.service.config
        stream = scope["path"].endswith("/trajectories")
        if (stream and self.streams >= limits.max_streams) or \
                (not stream and self.requests >= limits.max_requests):
            await _reply(send, 503, b'{"detail":"too many requests at once; retry"}',
                         [(b"retry-after", b"1")])
            return
        if declared_too_large(dict(scope["headers"]), limits.max_body_bytes):
            await _reply(send, 413, b'{"detail":"request body too large"}')
            return
        # An HTTPException, so that FastAPI's body reader passes it on (it turns any
        # other error into a 400) and answers the 413.
        limited = limit_body(receive, limits.max_body_bytes, _TooLarge)

        started = time.perf_counter()
        if stream:
            self.streams += 1
        else:
            self.requests += 1
        try:
            await self.app(scope, limited, send)
        finally:
            if stream:
                self.streams -= 1
            else:
                self.requests -= 1
            route = scope.get("route")
            name = getattr(route, "path", "other")
            self.service.rollouts.metrics.api_latency.observe(time.perf_counter() - started, name)


class _TooLarge(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(413, "request body too large")


async def _reply(send: Send, status: int, body: bytes,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["create_app"]

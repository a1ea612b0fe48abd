"""The HTTP API (FastAPI): rollouts as a service.

    POST /v1/jobs                        submit a job → 201 {job_id, planned}
    GET  /v1/jobs                        the newest jobs the caller sees (?limit=)
    GET  /v1/jobs/{id}                   status, counts by trajectory status, progress
    GET  /v1/jobs/{id}/trajectories      finished trajectories as NDJSON, in completion
                                         order: ?after=SEQ resumes after a sequence
                                         number, ?follow=true waits for the rest
    GET  /v1/jobs/{id}/timeline          its timeline page (HTML), running rows up to now
    GET  /v1/jobs/{id}/groups            its GRPO groups with their rewards
    GET  /v1/jobs/{id}/record            ?trajectory_id=: a finished one's record, no tokens
    POST /v1/jobs/{id}/cancel            cancel: unfinished trajectories become aborted
    POST /v1/rollouts                    one trajectory, answered when it ends
    POST /v1/sessions                    a session for an agent harness → 201 {session_id,
                                         base_url, job_id}; the harness sets base_url as
                                         its OpenAI base URL (docs/gateway.md)
    GET  /v1/sessions/{id}               an open session: turns, segments, children
    POST /v1/sessions/{id}/end           end it with its reward: its trajectory is stored
    POST /v1/sessions/{id}/openai/v1/chat/completions   one call of the session (OpenAI's
                                         shapes and errors; `treadle.gateway.wire`)
    GET  /v1/sessions/{id}/openai/v1/models             the served model's name
    GET  /v1/engines                     the engine pool
    POST /v1/engines                     register a running engine (health-checked)
    POST /v1/engines/{id}/drain          send it nothing more; removed once idle
    DELETE /v1/engines/{id}              remove it now (its turns move elsewhere)
    GET  /v1/weights                     the policy version and whether paused
    POST /v1/weights/pause               hold new engine calls ("drain" or "abort" those
                                         in flight); returns once none is in flight
    POST /v1/weights/resume              the engines serve `policy_version` now; go on
    POST /v1/weights/update              pause, every engine loads `weights_path`, resume
                                         with `policy_version` (vLLM in dev mode); mode
                                         abort | drain | keep, within timeout_s (504)
    POST /v1/keys                        a trainer key for a trainer run (admin) → 201
                                         {key_id, trainer_run, key}: the key only here
    GET  /v1/keys                        the trainer keys, never the keys themselves
    DELETE /v1/keys/{key_id}             revoke one made through the API
    GET  /healthz                        liveness (no auth); also the engine count, the
                                         policy version and `restart_s`, how long this
                                         service takes to come back after a restart
    GET  /metrics                        Prometheus text
    GET  /v1/status                      the service now and its last ten minutes (admin)
    GET  /dashboard                      the dashboard: a page that asks for a key and
                                         polls the routes above (its files need no key)

Each NDJSON line is ``{"seq": n, "trajectory": <record>}`` (the record:
`treadle.store.record`); a followed stream with nothing new writes a blank line
every `stream_heartbeat_s` (readers skip blank lines). Every route but `/healthz`
and the dashboard's page and files (`dashboard`: no data in them; the page sends
the key it asks for to the routes it reads) needs ``Authorization: Bearer <key>``
when the service has a token, the schema
(`/openapi.json`; there is no docs UI) included: 401 for no valid key, decided from
the headers before any body is read; the schema declares it as an HTTP bearer
scheme. Each route declares the scope it needs (`deps`; the keys and their
principals: `keys`, docs/security.md): the service token opens everything, a
trainer key its own run's jobs, sessions and weights (another run's job is a 404),
a session key its session's OpenAI routes and tools only (a 403 anywhere else). A
body over `max_body_bytes` is a 413, whether it declares its length or is sent
chunked, and one that takes longer than `body_timeout_s` to arrive a 408
(`limits.RequestGate`); more than `max_requests` requests at once (streams counted
apart, up to `max_streams`), or a job that would queue more than `max_queued`
trajectories, a 503 with Retry-After. Bad input is a 422 whose ``detail`` lists
``{"loc", "msg", "type"}`` per bad field (a body that is not strict JSON — not
UTF-8, NaN or infinite numbers, lone surrogates — one entry at ``["body"]``); an
unknown job or engine a 404; a job id already taken a 409; a method a route does not
have a 405 whose Allow header lists the ones it has. Every error body is
``{"detail": ...}`` (`schemas.ErrorReply`, bounded in size: `replies`), and the
OpenAPI schema declares each route's errors. No route runs code: tools run in the
service's sandboxes, only suites registered in the process can be named, and a file
a suite option names must lie under the service's `data_roots`.

Layout: one router per resource under `routes/`, the `Service` and the caller's
scope reached through typed dependencies (`deps`), one table from error class to
status (`replies.STATUS`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from treadle.service import replies
from treadle.service.limits import RequestGate
from treadle.service.routes import (
    dashboard,
    engines,
    jobs,
    keys,
    openai,
    rollouts,
    sessions,
    status,
    system,
    weights,
)
from treadle.service.state import Service


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
    app = _App(auth=service.keys.auth, title="treadle", version="1", lifespan=lifespan,
               openapi_url=None, docs_url=None, redoc_url=None,
               description="Rollouts for agentic RL: jobs of tasks in, token-exact "
                           "trajectories out.")
    app.state.service = service
    # The errors every authorised route can answer; routes add their own. Each route
    # declares its scope itself (deps), so that none is reached with the wrong one.
    common = replies.documented(*((401, 403) if service.keys.auth else ()), 408, 413, 503)
    app.include_router(system.health)
    app.include_router(dashboard.router)  # the page and its files: no data, no key
    routers = [m.router for m in (system, jobs, rollouts, sessions, openai, engines, weights,
                                  keys, status)]
    for router in routers:
        app.include_router(router, responses=common)
    replies.install(app, [route for r in [system.health, dashboard.router, *routers]
                          for route in r.routes])
    # The gate outermost: the chat door answers only what the gate has let in.
    app.add_middleware(openai.ChatDoor, service=service)
    app.add_middleware(RequestGate, service=service)
    return app


class _App(FastAPI):
    """FastAPI, whose schema declares no key on a service without a token (the
    routes' scope dependencies declare the bearer scheme: no key is asked for there)."""

    def __init__(self, *, auth: bool, **options: Any) -> None:
        super().__init__(**options)
        self.auth = auth

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None and not self.auth:
            built = super().openapi()
            built.get("components", {}).pop("securitySchemes", None)
            for operations in built.get("paths", {}).values():
                for operation in operations.values():
                    operation.pop("security", None)
        return super().openapi()

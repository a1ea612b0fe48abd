"""The service itself: liveness (no key), Prometheus metrics (the admin's: they
count every run's work), the OpenAPI schema (the admin's and trainers')."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from treadle.service.deps import AdminDep, CallerDep, ServiceDep

# Liveness answers without the token: `create_app` includes this router alone
# without the auth dependency.
health = APIRouter(tags=["service"])
router = APIRouter(tags=["service"])


@health.get("/healthz")
async def healthz(service: ServiceDep) -> dict[str, Any]:
    return {"status": "ok", "engines": len(service.runtime.engines()),
            "policy_version": service.runtime.policy_version,
            "tokenizer_fingerprint": service.tokenizer_fingerprint,
            "restart_s": service.restart_s}


@router.get("/metrics", responses={200: {"content": {"text/plain": {}}}})
async def metrics(_admin: AdminDep, service: ServiceDep) -> PlainTextResponse:
    # A JSON route otherwise, so that its errors are JSON like every other's.
    return PlainTextResponse(service.metrics_text())


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request, _caller: CallerDep) -> JSONResponse:
    return JSONResponse(request.app.openapi())

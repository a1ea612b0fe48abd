"""`/v1/sessions`: sessions a harness calls through the OpenAI-compatible gateway."""

from __future__ import annotations

from fastapi import APIRouter, Request

from treadle.service.deps import ServiceDep
from treadle.service.replies import documented
from treadle.service.schemas import SessionCreated, SessionEndRequest, SessionRequest, SessionView
from treadle.service.strict_json import StrictJSONRoute

router = APIRouter(prefix="/v1/sessions", route_class=StrictJSONRoute, tags=["sessions"])


@router.post("", status_code=201, responses=documented(400, 404, 409, 422))
async def create(body: SessionRequest, request: Request, service: ServiceDep) -> SessionCreated:
    base = service.config.public_url or str(request.base_url)
    return await service.gateway.create(body, base)


@router.get("/{session_id}", responses=documented(404))
async def session(session_id: str, service: ServiceDep) -> SessionView:
    return service.gateway.view(session_id)


@router.post("/{session_id}/end", responses=documented(404, 409, 422))
async def end(session_id: str, body: SessionEndRequest, service: ServiceDep) -> SessionView:
    return await service.gateway.end(session_id, body)

"""`/v1/sessions`: sessions a harness calls through the OpenAI-compatible gateway.

A session belongs to the key that made it: a trainer's session is seen and ended by
that run's keys (and the admin's), and by nobody else (a 404, as for an unknown
one). Each gets a key of its own (`api_key`), which opens its OpenAI routes only;
the session's end revokes it. A session treadle made for a harness job is ended by
treadle alone (409)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from treadle.gateway.errors import SessionBusy
from treadle.service.deps import CallerDep, OwnedSessionDep, ServiceDep
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

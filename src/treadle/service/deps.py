"""The routes' typed dependencies: the running `Service`, and who the request speaks
for, with the scope each route needs.

Every route but `/healthz` and the dashboard's files declares one of these in its
signature, and so the scope it needs (`tests/service/test_service_scopes.py` checks
that none is left out):

=================  ==================================================================
`AdminDep`         the service token only (engines' registration, keys, /metrics,
                   /v1/status)
`CallerDep`        the admin or a trainer key, never a session key (jobs, sessions,
                   weights: the route limits a trainer to its own run's)
`OwnedJobDep`      a caller who sees the path's job: the admin, or a trainer key of
                   the run that submitted it; anyone else gets the 404 an unknown job
                   gets, so that ids cannot be probed
`OwnedSessionDep`  a caller who sees the path's session (its maker's run, or the
                   admin); a 404 for anyone else
`DoorDep`          a session's OpenAI routes: that session's key, the admin, or the
                   trainer whose session it is
`SessionToolsDep`  the tools served to a harness job's session (`DoorDep`'s callers)
=================  ==================================================================

The key is checked twice on purpose: `limits.RequestGate` refuses a request without
a valid key (401), and a session key anywhere but its session's OpenAI routes (403),
from its headers alone, before any body is read or a request slot is taken; the
dependencies here declare the bearer scheme in the OpenAPI schema, resolve the key
again for routes reached some other way (an app mounted without the gate), and
check each route's scope. A trainer key on a route it may not use is refused once
the body is read (a 403): trainers are authenticated, and bounded by the gate's
limits like the admin.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from treadle.gateway.tools import SessionTools
from treadle.service.errors import Forbidden
from treadle.service.keys import (
    Admin,
    Caller,
    Principal,
    SessionGrant,
    SessionHolder,
    Trainer,
    sees,
)
from treadle.service.state import Service
from treadle.store.errors import NotFound
from treadle.store.jobs import JobInfo


async def get_service(request: Request) -> Service:
    """The service the app was made for (`create_app` keeps it on the app's state).
    A coroutine: FastAPI runs a plain function dependency on a worker thread, which
    cost every request a thread hop (about 0.7 ms of the service's CPU a call)."""
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]
_SCHEME = HTTPBearer(auto_error=False, description="the service token (treadle serve "
                                                    "--token), a trainer key or a session "
                                                    "key (docs/security.md)")


async def get_principal(service: ServiceDep, credentials: Annotated[
        HTTPAuthorizationCredentials | None, Depends(_SCHEME)]) -> Principal:
    """Who the request speaks for; 401 for a missing, wrong or expired key."""
    given = credentials.credentials.encode() if credentials is not None else b""
    found = service.keys.resolve(given)
    if found is None:
        raise HTTPException(401, "missing, wrong or expired bearer key",
                            headers={"WWW-Authenticate": "Bearer"})
    return found


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_caller(principal: PrincipalDep) -> Caller:
    """The admin or a trainer; a session key is a 403."""
    match principal:
        case Admin() | Trainer():
            return principal
        case SessionHolder():
            raise Forbidden("a session key opens its session's OpenAI routes and tools only")


CallerDep = Annotated[Caller, Depends(get_caller)]


async def get_admin(principal: PrincipalDep) -> Admin:
    """The admin only; any other key is a 403."""
    if isinstance(principal, Admin):
        return principal
    raise Forbidden("this route needs the service token")


AdminDep = Annotated[Admin, Depends(get_admin)]


async def get_owned_job(job_id: str, caller: CallerDep, service: ServiceDep) -> JobInfo:
    """The path's job, if the caller sees it; NotFound (404) as for an unknown one."""
    info = await service.store.job(job_id)
    if not sees(caller, info.owner):
        raise NotFound(f"no job {job_id!r}")
    return info


OwnedJobDep = Annotated[JobInfo, Depends(get_owned_job)]


async def get_owned_session(session_id: str, caller: CallerDep,
                            service: ServiceDep) -> SessionGrant | None:
    """The path's session's grant, if the caller sees it (`KeyRing.owned_session`)."""
    return service.keys.owned_session(caller, session_id)


OwnedSessionDep = Annotated[SessionGrant | None, Depends(get_owned_session)]


async def get_door(session_id: str, principal: PrincipalDep, service: ServiceDep) -> None:
    """A session's OpenAI routes (and its served tools): its own key, the admin, or
    its owner's trainer key.
    A session key of another session is a 403 (the gate refuses it first); a trainer
    not its owner gets the 404 an unknown session gets."""
    match principal:
        case SessionHolder(session_id=mine):
            if mine != session_id:
                raise Forbidden("a session key opens its own session's OpenAI routes and tools "
                                "only")
        case Admin() | Trainer():
            service.keys.owned_session(principal, session_id)


DoorDep = Annotated[None, Depends(get_door)]


async def get_session_tools(session_id: str, _door: DoorDep,
                            service: ServiceDep) -> SessionTools:
    """The tools served to the path's session, for those its door opens to; 404
    (UnknownSession, UnknownTool) for a session without served tools."""
    return service.gateway.tools(session_id)


SessionToolsDep = Annotated[SessionTools, Depends(get_session_tools)]


__all__ = ["AdminDep", "CallerDep", "DoorDep", "OwnedJobDep", "OwnedSessionDep", "PrincipalDep",
           "ServiceDep", "SessionToolsDep", "get_admin", "get_caller", "get_door", "get_owned_job",
           "get_owned_session", "get_principal", "get_service", "get_session_tools"]

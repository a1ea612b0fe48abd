"""The routes' typed dependencies: the running `Service`, and the bearer token.

The token is enforced twice on purpose: `limits.RequestGate` refuses a request
without it from its headers alone, before any body is read or a request slot is
taken; `bearer` (here) declares the scheme in the OpenAPI schema and checks again
for routes reached some other way (an app mounted without the gate).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from treadle.service.state import Service


async def get_service(request: Request) -> Service:
    """The service the app was made for (`create_app` keeps it on the app's state).
    A coroutine: FastAPI runs a plain function dependency on a worker thread, which
    cost every request a thread hop (about 0.7 ms of the service's CPU a call)."""
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]


def token_matches(given: bytes, token: str) -> bool:
    """Constant-time comparison of a presented token with the service's."""
    return hmac.compare_digest(given, token.encode())


def bearer(token: str | None) -> Callable[..., Awaitable[None]]:
    """The dependency every authorised route takes: nothing without a token, else
    HTTP bearer (declared in the schema; 401 when missing or wrong)."""
    if token is None:
        async def open_() -> None:
            return None
        return open_
    scheme = HTTPBearer(auto_error=False, description="the service's token "
                                                      "(treadle serve --token)")

    # A default, not Annotated: the annotation is a string (future import) that FastAPI
    # resolves in the module's namespace, where this local `scheme` is not.
    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme),  # noqa: B008
                    ) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if not token_matches(given, token):
            raise HTTPException(401, "missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})
    return check


__all__ = ["ServiceDep", "bearer", "get_service", "token_matches"]

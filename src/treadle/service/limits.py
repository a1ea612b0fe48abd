"""`RequestGate`: what every request passes before a route sees it.

In this order, each refusal answered from the headers alone, before anything of
the body is read:

1. `/healthz` passes untouched (liveness, no auth), and so do GETs of the
   dashboard's page and files (`dashboard.PUBLIC_PATHS`: fixed bytes, no data; the
   page reads everything through the key-checked routes).
2. The bearer key (when the service has a token): one the service does not know —
   missing, wrong, revoked, or a session key whose session has ended — is a 401 at
   once; a session key anywhere but its own session's OpenAI routes and tools a 403
   at once (`keys.opens_door`: a harness's key never makes the service read a body it may
   not send). An unauthorised client never makes the service read its body nor
   holds a request slot, so it cannot starve authorised ones. The routes then check
   the scope each needs (`deps`).
3. A slot: at most `max_requests` requests at once, NDJSON streams counted apart
   up to `max_streams`; past either a 503 with Retry-After.
4. The body: a declared Content-Length over `max_body_bytes` is a 413; a chunked
   body is counted as it arrives (413 once past it); the whole body must arrive
   within `body_timeout_s` of the first read (408), so a client trickling a body
   cannot hold its slot for ever.

It also times every request for the API latency histogram.
"""

from __future__ import annotations

import asyncio
import time

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.served import declared_too_large, limit_body
from treadle.service.dashboard import PUBLIC_PATHS
from treadle.service.keys import SessionHolder, opens_door
from treadle.service.state import Service

# The client reads it as `treadle.client.stream.RESTART_HEADER` (a test checks they
# agree; the service does not import the client).
RESTART_HEADER = "x-treadle-restart-s"


class RequestGate:
    """ASGI middleware; see the module docstring."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service
        self.requests = 0  # non-stream requests in progress
        self.streams = 0  # NDJSON streams in progress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._announcing(send)
        if scope["path"] == "/healthz" or (
                scope["path"] in PUBLIC_PATHS and scope["method"] == "GET"):
            await self.app(scope, receive, send)
            return
        config = self.service.config
        headers = dict(scope["headers"])
        principal = self.service.keys.principal(headers.get(b"authorization"))
        if principal is None:
            await _reply(send, 401, b'{"detail":"missing, wrong or expired bearer key"}',
                         [(b"www-authenticate", b"Bearer")])
            return
        if isinstance(principal, SessionHolder) and \
                not opens_door(principal.session_id, scope["path"]):
            await _reply(send, 403, b'{"detail":"a session key opens its own session\'s '
                                    b'OpenAI routes and tools only"}')
            return
        stream = scope["path"].endswith("/trajectories")
        if (stream and self.streams >= config.max_streams) or \
                (not stream and self.requests >= config.max_requests):
            await _reply(send, 503, b'{"detail":"too many requests at once; retry"}',
                         [(b"retry-after", b"1")])
            return
        if declared_too_large(headers, config.max_body_bytes):
            await _reply(send, 413, b'{"detail":"request body too large"}')
            return
        # HTTPExceptions, so that FastAPI's body reader passes them on (it turns any
        # other error into a 400) and answers them.
        limited = _deadline(limit_body(receive, config.max_body_bytes, _TooLarge),
                            config.body_timeout_s)
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
            self.service.rollouts.metrics.api_latency.observe(time.perf_counter() - started,
                                                              name)


    def _announcing(self, send: Send) -> Send:
        """`send`, adding the restart-time header to every answer: clients wait at
        least that long for a service that went away (`client.stream.RestartWatch`)."""
        header = (RESTART_HEADER.encode(),
                  f"{self.service.restart_s:g}".encode())

        async def announcing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        return announcing


def _deadline(receive: Receive, timeout_s: float) -> Receive:
    """`receive`, raising a 408 once the body has taken `timeout_s` since the first
    read. Only body messages are bounded: a stream's wait for the client to hang up
    (`http.disconnect`) may take as long as the stream lasts."""
    deadline: float | None = None
    body_done = False

    async def bounded() -> Message:
        nonlocal deadline, body_done
        if body_done:
            return await receive()
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise _TooSlow() from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return bounded


class _TooLarge(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(413, "request body too large")


class _TooSlow(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(408, "the request body did not arrive in time")


async def _reply(send: Send, status: int, body: bytes,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["RequestGate"]

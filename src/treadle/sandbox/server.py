"""`treadle sandbox-server`: host sandboxes of a local backend for remote clients over HTTP.

    treadle sandbox-server --port 8790 --token "$TOKEN" --backend bwrap --max-live 64

The wire format and the client are in `treadle.sandbox.remote`. Here: `SandboxHost`
(the sandboxes, the cap, idle reaping, draining, closing them all), `create_app`
(the HTTP edge: auth, request size limit, validation, errors as `ErrorReply`), and
the runners `serve` and `serve_in_thread`.

Trust (docs/sandbox.md, "remote"): a request with the token comes from the trainer;
it may keep up to `max_live` sandboxes with any `Limits` and run anything in them,
and reaches nothing else (no endpoint touches host files outside work dirs, runs
a command outside a sandbox or shows the server's environment; a sandbox's image,
with `--images DIR`, is one under DIR: `served_images`). Without the token
only `/healthz` answers. The token is compared in constant time. No TLS.

Limits: a body over `max_body_bytes` gets 413 before it is held whole; at most
`max_live` sandboxes (503 past it); a sandbox without a request for `idle_ttl_s`
(clients send keepalives) is reaped; an exec whose client disconnects is killed
at once; shutdown closes every sandbox before it drains requests. A SIGKILLed
server cannot clean up: bwrap trees die with it, the next start sweeps their dirs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import socket
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import uvicorn
from fastapi import FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from treadle.clock import MONOTONIC, Clock
from treadle.errors import SandboxClosed, SandboxError, SandboxStartError
from treadle.sandbox import wire
from treadle.sandbox.base import DEFAULT_MAX_GET_BYTES, ExecResult, Limits, Sandbox, SandboxBackend
from treadle.sandbox.served_images import ServedImages
from treadle.served import declared_too_large, limit_body, loopback_socket, serving_in_thread

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_IDLE_TTL_S = 120.0
MIN_TOKEN_CHARS = 16

T = TypeVar("T")
_M = TypeVar("_M", bound=BaseModel)


class UnknownSandbox(SandboxClosed):
    """No sandbox by that id: never made, closed, reaped, or made before a restart."""


@dataclass(eq=False, slots=True)
class _Hosted:
    sandbox: Sandbox
    last_used: float  # clock time of the last request's start or end
    busy: int = 0  # requests in flight; a busy sandbox is never reaped
    execs: dict[str, asyncio.Task[ExecResult]] = field(default_factory=dict)  # by exec id


class SandboxHost:
    """The sandboxes one server holds, by id. Lives in one event loop.

    `max_live` caps sandboxes that exist or are being created; `idle_ttl_s` is how
    long one may go without a request before the reaper (`reap_forever`) closes
    it (0 = never), in seconds of `clock`. `close` closes them all and refuses new
    ones.
    """

    def __init__(self, backend: SandboxBackend, *, max_live: int = 64,
                 idle_ttl_s: float = DEFAULT_IDLE_TTL_S, clock: Clock = MONOTONIC,
                 images: str | None = None) -> None:
        if max_live < 1 or idle_ttl_s < 0:
            raise ValueError("max_live must be >= 1 and idle_ttl_s >= 0")
        self.backend = backend
        self.images = ServedImages(backend, images)  # which images clients may name
        self.max_live = max_live
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._sandboxes: dict[str, _Hosted] = {}
        self._creating: set[str] = set()
        self._doomed: set[str] = set()  # deleted while being created
        self.closing = False  # set by close(): no new sandboxes
        # Set by drain(): no new sandboxes, those here carry on (a fleet retiring it).
        self.draining = False
        self._background: set[asyncio.Task[None]] = set()

    @property
    def live(self) -> int:
        return len(self._sandboxes) + len(self._creating)

    def ids(self) -> list[str]:
        return sorted(self._sandboxes)

    async def create(self, sandbox_id: str, limits: Limits, image: str | None = None) -> Sandbox:
        """Start a sandbox under `sandbox_id` (on `image`: `ServedImages`);
        SandboxStartError when full or closing, SandboxImageError for an image this
        server does not run."""
        backend = self.images.backend_for(image)
        if self.closing:
            raise SandboxStartError("the sandbox server is shutting down")
        if self.draining:
            raise SandboxStartError("the sandbox server is draining: it takes no new "
                                    "sandboxes")
        if sandbox_id in self._sandboxes or sandbox_id in self._creating:
            raise ValueError(f"sandbox id {sandbox_id!r} is in use")
        if self.live >= self.max_live:
            raise SandboxStartError(f"the sandbox server is full ({self.max_live} sandboxes)")
        self._creating.add(sandbox_id)
        try:
            sandbox = await backend.start(limits)
        finally:
            self._creating.discard(sandbox_id)
        if self.closing or sandbox_id in self._doomed:
            self._doomed.discard(sandbox_id)
            await self._close_shielded(sandbox)
            raise SandboxClosed("the sandbox was deleted (or the server closed) while starting")
        self._sandboxes[sandbox_id] = _Hosted(sandbox, self._clock.now())
        return sandbox

    def _lookup(self, sandbox_id: str) -> _Hosted:
        hosted = self._sandboxes.get(sandbox_id)
        if hosted is None:
            raise UnknownSandbox(f"no sandbox {sandbox_id!r} on this server (closed, reaped "
                                 "after its idle TTL, or the server restarted)")
        return hosted

    @contextlib.asynccontextmanager
    async def use(self, sandbox_id: str) -> AsyncIterator[Sandbox]:
        """The sandbox, marked busy (not reapable) for the block; its use postpones reaping."""
        hosted = self._lookup(sandbox_id)
        hosted.busy += 1
        hosted.last_used = self._clock.now()
        try:
            yield hosted.sandbox
        finally:
            hosted.busy -= 1
            hosted.last_used = self._clock.now()

    async def exec(self, sandbox_id: str, exec_id: str, argv: list[str], *, timeout_s: float,
                   stdin: bytes | None, env: dict[str, str]) -> ExecResult:
        """Run one exec, interruptible by `interrupt(sandbox_id, exec_id)`."""
        hosted = self._lookup(sandbox_id)
        if exec_id in hosted.execs:
            raise ValueError(f"exec id {exec_id!r} is in use")
        async with self.use(sandbox_id) as sandbox:
            task = asyncio.ensure_future(sandbox.exec(argv, timeout_s=timeout_s, stdin=stdin,
                                                      env=env))
            hosted.execs[exec_id] = task
            try:
                return await task  # cancelling us cancels it, which kills its tree first
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():
                    raise
                raise SandboxClosed("the exec was interrupted by its client") from None
            finally:
                hosted.execs.pop(exec_id, None)

    async def interrupt(self, sandbox_id: str, exec_id: str) -> None:
        """Kill one exec's tree and wait until it is gone; no-op for an unknown exec.

        (An interrupt that overtakes its exec finds nothing, but then the exec's
        client has given up and closed its connection, which kills the exec.)
        """
        hosted = self._sandboxes.get(sandbox_id)
        task = hosted.execs.get(exec_id) if hosted is not None else None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def destroy(self, sandbox_id: str) -> None:
        """Close a sandbox (killing its execs) and forget it. Idempotent."""
        if sandbox_id in self._creating:
            self._doomed.add(sandbox_id)
            return
        hosted = self._sandboxes.pop(sandbox_id, None)
        if hosted is not None:
            await self._close_shielded(hosted.sandbox)

    async def reap_idle(self) -> int:
        """Close every sandbox idle for longer than the TTL; how many were closed."""
        if not self.idle_ttl_s:
            return 0
        now = self._clock.now()
        idle = [sid for sid, h in self._sandboxes.items()
                if h.busy == 0 and now - h.last_used > self.idle_ttl_s]
        for sandbox_id in idle:
            log.info("reaping sandbox %s: no request for %.0fs", sandbox_id, self.idle_ttl_s)
        await asyncio.gather(*(self.destroy(sid) for sid in idle))
        return len(idle)

    async def reap_forever(self) -> None:
        """Reap idle sandboxes until cancelled (returns at once without a TTL)."""
        interval = min(max(self.idle_ttl_s / 4, 0.05), 5.0)
        while self.idle_ttl_s:
            await self._clock.sleep(interval)
            try:
                await self.reap_idle()
            except Exception:  # a failing close must not end the reaping
                log.exception("reaping idle sandboxes failed")

    def drain(self) -> None:
        """Refuse new sandboxes from now on; those open or starting carry on. After it,
        `live` only falls: once it is 0 the server may be stopped without ending a
        sandbox. Idempotent; there is no undoing it (a fleet starts a new server)."""
        self.draining = True

    def health(self) -> wire.Health:
        status = "closing" if self.closing else "draining" if self.draining else "ok"
        return wire.Health(status=status, backend=self.backend.name, live=self.live,
                           max_live=self.max_live)

    async def close(self) -> None:
        """Close every sandbox, including ones still starting; refuse new ones. Idempotent."""
        self.closing = True
        hosted = list(self._sandboxes.values())
        self._sandboxes.clear()
        await asyncio.gather(*(self._close_shielded(h.sandbox) for h in hosted))
        while self._creating:  # each in-flight create closes what it made; rare, brief
            await asyncio.sleep(0.05)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _close_shielded(self, sandbox: Sandbox) -> None:
        # A referenced task: a cancelled request cannot stop a close halfway.
        task = asyncio.ensure_future(sandbox.close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        await asyncio.shield(task)


# Module level: FastAPI resolves the (string) annotations of routes in module globals.
SandboxIdParam = Annotated[str, Path(pattern=wire.ID_PATTERN)]
PathParam = Annotated[str, Query(min_length=1, max_length=4096)]


class _BodyTooLarge(Exception):
    pass


def _json(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status, headers, media_type="application/json")


def _error_response(status: int, kind: str, message: str,
                    headers: dict[str, str] | None = None) -> Response:
    return _json(wire.ErrorReply(error=wire.ErrorBody(type=kind, message=message)), status,
                 headers)


class _Guard:
    """ASGI middleware: auth, then the size limit, both before the body is read."""

    def __init__(self, app: ASGIApp, token: str, max_body_bytes: int) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if scope["path"] != "/healthz" and not hmac.compare_digest(
                headers.get(b"authorization", b""), self._expected):
            response = _error_response(401, "Unauthorized", "missing or wrong bearer token",
                                       {"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        if declared_too_large(headers, self.max_body_bytes):
            await self._too_large()(scope, receive, send)
            return
        counted = limit_body(receive, self.max_body_bytes, _BodyTooLarge)
        await self.app(scope, counted, send)

    def _too_large(self) -> Response:
        return _error_response(413, "ValueError", f"request body exceeds the server's limit "
                                                  f"of {self.max_body_bytes} bytes")


def create_app(host: SandboxHost, token: str, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ASGIApp:
    """The server's ASGI app; its lifespan runs the reaper and closes `host` at the end."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the token must have at least {MIN_TOKEN_CHARS} characters")

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.ensure_future(host.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            await host.close()

    # No docs or schema endpoints: nothing answers without the token but /healthz.
    app = FastAPI(title="treadle sandbox server", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    guard = _Guard(app, token, max_body_bytes)

    async def on_error(_request: Request, exc: Exception) -> Response:
        if isinstance(exc, _BodyTooLarge):
            return guard._too_large()
        if isinstance(exc, RequestValidationError):
            return _error_response(400, "ValueError", f"invalid request: {exc.errors()!r:.500}")
        name, status = wire.wire_error(exc)
        if status == 500:
            log.error("sandbox server error: %r", exc)
        return _error_response(404 if isinstance(exc, UnknownSandbox) else status, name, str(exc))

    for exc_class in (SandboxError, ValueError, RequestValidationError, _BodyTooLarge):
        app.add_exception_handler(exc_class, on_error)

    async def read(request: Request, model: type[_M]) -> _M:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as e:
            raise ValueError(f"invalid {model.__name__}: {e.errors(include_url=False)!r:.500}")\
                from None

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json(host.health())

    @app.post("/v1/drain")
    async def drain() -> Response:
        host.drain()
        return _json(host.health())  # `live` as of the drain: from here it only falls

    @app.get("/v1/sandboxes")
    async def list_sandboxes() -> Response:
        return _json(wire.SandboxList(ids=host.ids()))

    @app.post("/v1/sandboxes")
    async def create(request: Request) -> Response:
        body = await read(request, wire.CreateRequest)
        sandbox = await host.create(body.id, body.limits.to_limits(), body.image)
        return _json(wire.Created(id=body.id, workdir=sandbox.workdir,
                                  idle_ttl_s=host.idle_ttl_s, max_body_bytes=max_body_bytes),
                     status=201)

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_(sandbox_id: SandboxIdParam, request: Request) -> Response:
        body = await read(request, wire.ExecRequest)
        # Invalid base64 raises binascii.Error, a ValueError: a 400 like any bad input.
        stdin = None if body.stdin_b64 is None else base64.b64decode(body.stdin_b64,
                                                                     validate=True)
        result = await _unless_disconnected(request, host.exec(
            sandbox_id, body.exec_id, body.argv, timeout_s=body.timeout_s, stdin=stdin,
            env=body.env))
        if result is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        return _json(wire.ExecReply.from_result(result))

    @app.delete("/v1/sandboxes/{sandbox_id}/execs/{exec_id}")
    async def interrupt(sandbox_id: SandboxIdParam,
                        exec_id: SandboxIdParam) -> Response:
        await host.interrupt(sandbox_id, exec_id)
        return Response(status_code=204)

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    async def put_file(sandbox_id: SandboxIdParam, path: PathParam,
                       request: Request) -> Response:
        data = await request.body()
        async with host.use(sandbox_id) as sandbox:
            await sandbox.put_file(path, data)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def get_file(sandbox_id: SandboxIdParam, path: PathParam,
                       max_bytes: Annotated[int, Query(ge=0)] = DEFAULT_MAX_GET_BYTES,
                       ) -> Response:
        async with host.use(sandbox_id) as sandbox:
            data = await sandbox.get_file(path, min(max_bytes, max_body_bytes))
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/sandboxes/{sandbox_id}/keepalive")
    async def keepalive(sandbox_id: SandboxIdParam) -> Response:
        async with host.use(sandbox_id):  # an empty use: it only postpones the reaping
            return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}")
    async def delete(sandbox_id: SandboxIdParam) -> Response:
        await host.destroy(sandbox_id)
        return Response(status_code=204)

    return guard


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None (`work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request was cancelled: never leave the exec running
        task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
        raise
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    if task.done():
        return task.result()
    task.cancel()  # the client is gone: kill the tree now, not at its timeout
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Server(uvicorn.Server):
    """uvicorn serving `create_app`, closing the sandboxes before it drains requests."""

    def __init__(self, host: SandboxHost, token: str, *, bind: str, port: int,
                 max_body_bytes: int, log_level: str) -> None:
        self.sandbox_host = host
        super().__init__(uvicorn.Config(
            create_app(host, token, max_body_bytes=max_body_bytes), host=bind, port=port,
            log_level=log_level, access_log=False, lifespan="on", http="h11", loop="asyncio",
            ws="none", timeout_graceful_shutdown=10, server_header=False))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Sandboxes first: running execs then end at once (SandboxClosed) instead of
        # holding the graceful shutdown open for their full timeouts.
        await self.sandbox_host.close()
        await super().shutdown(sockets)


async def probe_backend(backend: SandboxBackend) -> None:
    """Start and close one sandbox: SandboxUnavailable now rather than on the first client."""
    sandbox = await backend.start(Limits())
    await sandbox.close()


async def serve(host: SandboxHost, token: str, *, bind: str = "127.0.0.1", port: int = 8790,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info") -> None:
    """Probe the backend, then serve until SIGINT/SIGTERM; every sandbox is closed at the end."""
    await probe_backend(host.backend)
    await _Server(host, token, bind=bind, port=port, max_body_bytes=max_body_bytes,
                  log_level=log_level).serve()


@dataclass(frozen=True, slots=True)
class RunningServer:
    """A server started by `serve_in_thread`."""

    url: str  # http://127.0.0.1:<port>
    host: SandboxHost  # lives in the server's thread and loop: read, do not call


@contextlib.contextmanager
def serve_in_thread(backend: SandboxBackend, token: str, *, max_live: int = 64,
                    idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                    startup_timeout_s: float = 30.0,
                    images: str | None = None) -> Iterator[RunningServer]:
    """A server on 127.0.0.1 (a free port) in a thread of this process, for tests and benches.

    Its sandboxes are children of this process. On exit it shuts down as on
    SIGTERM (every sandbox closed) and the thread is joined. RuntimeError if it
    does not start. `backend` must not be used by any other event loop.
    """
    sock = loopback_socket()
    port = sock.getsockname()[1]
    host = SandboxHost(backend, max_live=max_live, idle_ttl_s=idle_ttl_s, images=images)
    server = _Server(host, token, bind="127.0.0.1", port=port, max_body_bytes=max_body_bytes,
                     log_level="warning")
    with serving_in_thread(server, sock, name=f"sandbox-server-{port}",
                           startup_timeout_s=startup_timeout_s, join_timeout_s=60.0,
                           before=lambda: probe_backend(backend)):
        yield RunningServer(url=f"http://127.0.0.1:{port}", host=host)

"""One sandbox on a sandbox server, as the `remote` backend's client holds it:
`RemoteSandbox`, and what every call of that client goes through (a reply parsed,
an error answer raised as the exception it names: `parse_reply`, `error_reply`).

`treadle.sandbox.remote.RemoteBackend` places and creates sandboxes; this module is
what one is once created. Contracts beyond `base`:

- Transport failures, server errors and malformed answers raise `RemoteSandboxError`
  (a `SandboxError`: the infrastructure failed, not the agent). A sandbox the
  server no longer knows (closed, reaped, server restarted) raises `SandboxClosed`.
- A cancelled exec has the server kill its tree, waiting at most
  `_INTERRUPT_TIMEOUT_S`, before `CancelledError` propagates; an unreachable
  server kills it anyway when it sees the connection drop.
- An open sandbox sends a keepalive every third of the server's idle TTL, so a long
  pause between tool calls (the model generating) does not get it reaped; a
  vanished client stops them, and the server reaps its sandboxes.
- A sandbox owns its HTTP connections and belongs to the event loop that started it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from treadle.errors import SandboxClosed, SandboxError, SandboxFileTooLarge
from treadle.sandbox.base import DEFAULT_MAX_GET_BYTES, ExecResult, Limits, Sandbox
from treadle.sandbox.wire import WIRE_ERRORS, Created, ErrorReply, ExecReply, ExecRequest

log = logging.getLogger(__name__)

_EXEC_SLACK_S = 20.0  # beyond the exec's own timeout: server-side kill waits, drain, transfer
_INTERRUPT_TIMEOUT_S = 15.0  # a cancelled exec waits this long for the server's kill
CLOSE_TIMEOUT_S = 15.0
JSON_HEADERS = {"content-type": "application/json"}


class RemoteSandboxError(SandboxError):
    """The sandbox server could not be reached, failed, or answered something unexpected."""


_BY_NAME = {cls.__name__: cls for cls, _ in WIRE_ERRORS}


_M = TypeVar("_M", bound=BaseModel)


def parse_reply(model: type[_M], response: httpx.Response, server: str) -> _M:
    """`response` as `model`; RemoteSandboxError when it is not one."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError:
        raise RemoteSandboxError(f"{server}: malformed {model.__name__} answer") from None


def error_reply(response: httpx.Response, server: str) -> Exception:
    """The exception a non-2xx answer stands for."""
    try:
        body = ErrorReply.model_validate_json(response.content).error
    except ValidationError:
        return RemoteSandboxError(f"{server}: HTTP {response.status_code}")
    cls = _BY_NAME.get(body.type)
    return (cls(f"{body.message} (sandbox server {server})") if cls is not None
            else RemoteSandboxError(f"{server}: {body.type}: {body.message}"))


@dataclass(slots=True)
class ServerSlot:
    """A server as one backend places on it (its sandboxes close their count here)."""

    url: str
    outstanding: int = 0  # sandboxes of this backend open there (or being created)
    retiring: bool = False  # takes no new sandboxes (retire_server)
    failures: int = 0  # consecutive transport failures; > 0 = suspect, probe before use
    retry_at: float = 0.0  # monotonic time before which a suspect server is skipped


async def abandon(client: httpx.AsyncClient, sandbox_id: str, *, delete: bool) -> None:
    """Best-effort delete of a sandbox whose start failed, then drop the connection."""
    with contextlib.suppress(httpx.HTTPError):
        if delete:
            await client.delete(f"/v1/sandboxes/{sandbox_id}", timeout=CLOSE_TIMEOUT_S)
    await client.aclose()


_pending: set[asyncio.Task[Any]] = set()  # shielded cleanups, referenced until done


async def shielded(coro: Any) -> None:
    """Run a cleanup to the end even if the caller is cancelled meanwhile."""
    task: asyncio.Task[Any] = asyncio.ensure_future(coro)
    _pending.add(task)
    task.add_done_callback(_pending.discard)
    await asyncio.shield(task)


class RemoteSandbox(Sandbox):
    """A sandbox on one server; every call is one HTTP request to it."""

    def __init__(self, *, server: ServerSlot, client: httpx.AsyncClient, created: Created,
                 limits: Limits) -> None:
        self._server = server
        self._client = client
        self.id = created.id  # the server's name for it
        self.server = server.url  # the URL of the server hosting it
        self._workdir = created.workdir
        self._max_body_bytes = created.max_body_bytes
        self._limits = limits
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._running: set[asyncio.Task[httpx.Response]] = set()
        beat_s = max(created.idle_ttl_s / 3, 0.05)  # a third of the TTL: two beats may fail
        self._keepalive = (asyncio.ensure_future(self._keep_alive(beat_s))
                           if created.idle_ttl_s > 0 else None)

    @property
    def workdir(self) -> str:
        return self._workdir

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def closed(self) -> bool:
        return self._closed

    async def exec(self, argv: Sequence[str], *, timeout_s: float, stdin: bytes | None = None,
                   env: Mapping[str, str] | None = None) -> ExecResult:
        args, extra_env, timeout_s = self._checked_exec(argv, timeout_s, env)
        if stdin is not None and (len(stdin) + 2) // 3 * 4 > self._max_body_bytes:
            raise ValueError(f"stdin of {len(stdin)} bytes exceeds the server's request "
                             f"limit ({self._max_body_bytes} bytes, base64-encoded)")
        exec_id = secrets.token_urlsafe(12)
        body = ExecRequest(exec_id=exec_id, argv=args, timeout_s=timeout_s, env=extra_env,
                           stdin_b64=None if stdin is None else base64.b64encode(stdin).decode())
        # A task of its own, so that close() can cancel it.
        task = asyncio.ensure_future(self._call(
            "POST", "/exec", content=body.model_dump_json(), headers=JSON_HEADERS,
            timeout=httpx.Timeout(timeout_s + _EXEC_SLACK_S, connect=self._client.timeout.connect)))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        try:
            response = await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is None or me.cancelling():
                # Our caller was cancelled: have the server kill the tree first.
                task.cancel()
                await shielded(self._interrupt(exec_id))
                raise
            raise SandboxClosed("sandbox was closed while the command ran") from None
        return parse_reply(ExecReply, response, self.server).to_result()

    async def _interrupt(self, exec_id: str) -> None:
        try:
            await self._call("DELETE", f"/execs/{exec_id}", timeout=_INTERRUPT_TIMEOUT_S)
        except SandboxError as e:  # the server also kills it when it sees the connection drop
            log.warning("could not interrupt exec %s on %s: %s", exec_id, self.server, e)

    async def put_file(self, path: str, data: bytes) -> None:
        self._check_open()
        if len(data) > self._max_body_bytes:
            raise SandboxFileTooLarge(f"{len(data)} bytes exceed the sandbox server's request "
                                      f"limit of {self._max_body_bytes}")
        await self._call("PUT", "/files", params={"path": path}, content=bytes(data))

    async def get_file(self, path: str, max_bytes: int = DEFAULT_MAX_GET_BYTES) -> bytes:
        self._check_open()  # a negative max_bytes: the server answers ValueError
        response = await self._call("GET", "/files",
                                    params={"path": path, "max_bytes": str(max_bytes)})
        if len(response.content) > max_bytes:
            raise RemoteSandboxError(f"{self.server} sent more than max_bytes={max_bytes}")
        return response.content

    async def close(self) -> None:
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._finish_close())
        # Every caller waits for the one cleanup; shielded so that it always finishes.
        await asyncio.shield(self._closing)

    async def _finish_close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
        try:
            # The server kills running execs and removes the work dir before answering.
            await self._call("DELETE", "", timeout=CLOSE_TIMEOUT_S)
        except SandboxError as e:  # (a DELETE of an unknown sandbox succeeds)
            log.warning("could not close sandbox %s on %s (%s); the server reaps it after "
                        "its idle TTL", self.id, self.server, e)
        finally:
            for task in list(self._running):
                task.cancel()
            await asyncio.gather(*self._running, return_exceptions=True)
            await self._client.aclose()
            self._server.outstanding -= 1

    async def _keep_alive(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._call("POST", "/keepalive", timeout=max(interval_s, 5.0))
            except SandboxClosed:
                return  # the server no longer has it: nothing left to keep alive
            except SandboxError as e:  # transient: the next beat may get through
                log.debug("keepalive of %s on %s failed: %s", self.id, self.server, e)

    async def _call(self, method: str, suffix: str, **kwargs: Any) -> httpx.Response:
        """One request about this sandbox; a non-2xx answer or a transport failure raises."""
        try:
            response = await self._client.request(method, f"/v1/sandboxes/{self.id}{suffix}",
                                                  **kwargs)
        except httpx.HTTPError as e:
            raise RemoteSandboxError(f"{self.server}: {e!r}") from e
        if response.status_code >= 300:
            raise error_reply(response, self.server)
        return response


__all__ = ["RemoteSandbox", "RemoteSandboxError", "ServerSlot", "abandon", "error_reply",
           "parse_reply", "shielded"]

"""Running one of treadle's HTTP servers (uvicorn) in a thread of this process.

For tests, benchmarks and `treadle run`'s in-process service: the server shares
the interpreter (and its lock) with the caller, so timings taken through it
include that contention.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from starlette.types import Message, Receive

log = logging.getLogger(__name__)


def loopback_socket() -> socket.socket:
    """A TCP socket bound to a free port on 127.0.0.1 (read it with getsockname)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serving_in_thread(server: uvicorn.Server, sock: socket.socket, *, name: str,
                      startup_timeout_s: float = 30.0, join_timeout_s: float = 30.0,
                      before: Callable[[], Awaitable[None]] | None = None) -> Iterator[None]:
    """Serve on `sock` in a daemon thread until the block exits; `before` runs first
    on the server's loop. RuntimeError (chained to the server's own error) if it is
    not up within `startup_timeout_s`. On exit the server shuts down as on SIGTERM,
    the thread is joined and the socket closed."""
    failure: list[BaseException] = []

    async def main() -> None:
        if before is not None:
            await before()
        await server.serve([sock])

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # reported to the starting thread
            failure.append(e)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start") from (failure[0] if failure else None)
            time.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        thread.join(join_timeout_s)
        if thread.is_alive():
            log.error("%s did not stop within %.0f s", name, join_timeout_s)
        sock.close()


def declared_too_large(headers: dict[bytes, bytes], max_bytes: int) -> bool:
    """Whether a request's Content-Length is unreadable or above `max_bytes`."""
    declared = headers.get(b"content-length")
    return declared is not None and (not declared.isdigit() or int(declared) > max_bytes)


def limit_body(receive: Receive, max_bytes: int,
               too_large: Callable[[], Exception]) -> Receive:
    """`receive`, raising `too_large()` once the body read so far exceeds `max_bytes`
    (a chunked body declares no length, so it is counted as it arrives)."""
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise too_large()
        return message

    return counted

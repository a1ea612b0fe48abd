"""`engines._wire.WirePool` against a scripted raw HTTP server: body framings, reuse,
the stale keep-alive retry, cancel closing the connection, timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from treadle.engines._wire import WireError, WirePool

# A handler gets the connection's index and the request's (head, body); it writes the
# reply (or nothing) and says whether to keep serving the connection.
Handler = Callable[[int, bytes, bytes, asyncio.StreamWriter], Awaitable[bool]]


class Server:
    """A loopback HTTP/1.1 server whose replies a test scripts."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []
        self.eof = asyncio.Event()  # a client closed a connection mid-request
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *_exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = 0
                for line in head.decode("latin-1").split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append((index, head, body))
                if not await self.handler(index, head, body, writer):
                    writer.close()
                    return
                await writer.drain()
        finally:
            writer.close()


def ok(body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_content_length_replies_reuse_one_connection() -> None:
    async def handler(_i: int, _head: bytes, body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(ok(b'{"echo":' + body + b"}"))
        return True

    async def main() -> None:
        srv = Server(handler)
        async with srv as url:
            pool = WirePool(url + "/prefix", headers={"Authorization": "Bearer t"})
            for k in range(3):
                reply = await pool.request("POST", "/v1/x", str(k).encode(), {"x-id": "a"})
                assert reply.status == 200 and reply.body == b'{"echo":%d}' % k
            await pool.aclose()
        assert srv.connections == 1
        head = srv.requests[0][1].decode()
        assert head.startswith("POST /prefix/v1/x HTTP/1.1\r\n")
        assert "authorization: Bearer t\r\n" in head and "x-id: a\r\n" in head

    asyncio.run(main())


def test_chunked_and_close_delimited_bodies() -> None:
    async def handler(_i: int, _head: bytes, _body: bytes, w: asyncio.StreamWriter) -> bool:
        if len(srv.requests) == 1:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n")
            return True
        w.write(b"HTTP/1.0 503 Busy\r\n\r\nno length here")
        return False  # the close ends the body

    srv = Server(handler)

    async def main() -> None:
        async with srv as url:
            pool = WirePool(url)
            assert (await pool.request("GET", "/a")).body == b"hello world"
            reply = await pool.request("GET", "/b")  # on the same connection
            assert reply.status == 503 and reply.text == "no length here"
            assert (await pool.request("GET", "/c")).status == 503  # not reused: anew
            await pool.aclose()
        assert [r[0] for r in srv.requests] == [0, 0, 1]

    asyncio.run(main())


def test_a_reused_connection_closed_unanswered_is_retried_once_anew() -> None:
    async def handler(i: int, _head: bytes, _body: bytes, w: asyncio.StreamWriter) -> bool:
        if i == 0 and len(srv.requests) == 2:
            return False  # its keep-alive "timed out" as the second request came
        w.write(ok(b"{}"))
        return True

    srv = Server(handler)

    async def main() -> None:
        async with srv as url:
            pool = WirePool(url)
            await pool.request("POST", "/x", b"{}")
            assert (await pool.request("POST", "/x", b"{}")).body == b"{}"
            await pool.aclose()
        assert srv.connections == 2 and [r[0] for r in srv.requests] == [0, 0, 1]

    asyncio.run(main())


def test_cancel_closes_the_connection_and_timeouts_raise() -> None:
    received = asyncio.Event()

    async def handler(_i: int, _head: bytes, _body: bytes, _w: asyncio.StreamWriter) -> bool:
        received.set()
        return True  # never replies

    async def main() -> None:
        srv = Server(handler)
        async with srv as url:
            pool = WirePool(url)
            call = asyncio.ensure_future(pool.request("POST", "/hang", b"{}"))
            await received.wait()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            received.clear()
            with pytest.raises(TimeoutError):
                await pool.request("POST", "/hang", b"{}", timeout_s=0.05)
            await pool.aclose()
        # Neither connection went back to the pool: each request had its own.
        assert srv.connections == 2

    asyncio.run(main())


def test_refused_and_malformed_replies_are_wire_errors() -> None:
    async def handler(_i: int, _head: bytes, _body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"SMTP ready\r\n\r\n")
        return True

    async def main() -> None:
        srv = Server(handler)
        async with srv as url:
            pool = WirePool(url)
            with pytest.raises(WireError, match="not an HTTP"):
                await pool.request("GET", "/")
            await pool.aclose()
        with pytest.raises(WireError, match="cannot connect"):
            await WirePool(url).request("GET", "/")

    asyncio.run(main())


def test_a_url_that_is_not_ascii_is_refused_where_it_enters() -> None:
    """A request line and a Host header are ASCII: an internationalised host must come
    in its IDNA form. Refused when the pool is made and at the API's edge (422), never
    a crash at the first request (the API fuzz found one, a 500)."""
    from pydantic import ValidationError

    from treadle.service.schemas import EngineRequest

    for url in ("http://b\u00fccher.de:8000", "http://127.0.0.1:8000/\u00fc", "http://\U000250eb.com"):
        with pytest.raises(ValueError, match="not an ASCII URL"):
            WirePool(url)
        with pytest.raises(ValidationError, match="not an ASCII URL"):
            EngineRequest(url=url)
    WirePool("http://xn--bcher-kva.de:8000")  # the IDNA form is fine
    assert EngineRequest(url="http://xn--bcher-kva.de:8000").url == "http://xn--bcher-kva.de:8000"

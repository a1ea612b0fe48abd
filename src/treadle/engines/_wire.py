"""A lean HTTP/1.1 client for the engine clients: keep-alive connections to one origin
in an O(1) idle pool, replies read whole into bytes. Internal to treadle.engines.

Why not httpx: at thousands of concurrent calls its pool scans every connection on
each request and each response (O(connections) per call), and its request/response
models cost more CPU than the JSON inside them. This client does what the engine
calls need and no more:

- `WirePool.request(method, path, body, headers, timeout_s)` sends one request on an
  idle connection (the most recently used: LIFO keeps the warm ones warm) or a new
  one, and returns a `WireReply` (status, lower-cased headers, the whole body).
- Bodies are read by Content-Length, chunked transfer coding, or to the connection's
  close. A connection goes back to the pool only after a complete keep-alive reply.
- Cancelling a request closes its connection: that is how vLLM learns to abort.
- A reused connection that the server closed before any byte of the reply (its
  keep-alive timer raced our request) is retried once on a new connection; idle
  connections older than `idle_s` are closed rather than reused, which keeps that
  race rare (uvicorn closes idle connections after 5 s).

Errors: `WireError` (connect refused/reset, a malformed reply) and `TimeoutError`
(connect or `timeout_s`), which `_http.HttpEngine` translates, in one place. No
proxies, no redirects, no HTTP/2, no request streaming: engines need none.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from treadle.engines.errors import EngineUnavailable

_MAX_HEAD = 64 * 1024  # a reply head past this is malformed


class WireError(EngineUnavailable):
    """The connection failed or the reply is not HTTP/1.x (`_http` translates it, with
    the engine's name, where the call is made)."""


@dataclass(frozen=True, slots=True)
class WireReply:
    """One reply: status, headers (names lower-cased, last value wins), whole body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Connection(asyncio.Protocol):
    """One socket; reads one reply at a time into `done`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.keep_alive = True
        self._buf = bytearray()
        self._done: asyncio.Future[WireReply] | None = None
        self._got_bytes = False  # any byte of the pending reply arrived
        self._status = 0
        self._headers: dict[str, str] | None = None  # set once the head is parsed
        self._length = -1  # Content-Length, or -1: chunked (`_chunked`) or to-close
        self._chunked = False
        self._chunks: list[bytes] = []
        self._pos = 0  # chunked: offset in `_buf` of the next chunk-size line

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        self._got_bytes = True
        self._buf += data
        try:
            self._advance()
        except WireError as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        done = self._done
        if done is None or done.done():
            return
        if self._headers is not None and self._length < 0 and not self._chunked:
            self._finish(bytes(self._buf))  # a body delimited by the close
            return
        self._fail(WireError("the server closed the connection" + (
            "" if self._got_bytes else " before replying") + (f" ({exc!r})" if exc else "")))

    # -- one exchange ----------------------------------------------------------------

    def send(self, head: bytes, body: bytes | None) -> asyncio.Future[WireReply]:
        """Write one request; the future is its reply."""
        assert self.transport is not None and not self.closed
        self._done = asyncio.get_running_loop().create_future()
        self._got_bytes = False
        self._buf.clear()
        self._headers = None
        self._chunks.clear()
        self._pos = 0
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        return self._done

    @property
    def replied_nothing(self) -> bool:
        return not self._got_bytes

    def close(self) -> None:
        self.closed = True
        done = self._done
        if done is not None and not done.done():
            # Its waiter, if any (the pool closing under it), gets a WireError; marked
            # retrieved so that a waiter already gone (cancelled) leaves no warning.
            done.set_exception(WireError("the connection was closed"))
            done.exception()
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: Exception) -> None:
        self.keep_alive = False
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self.close()

    def _finish(self, body: bytes) -> None:
        assert self._headers is not None and self._done is not None
        reply = WireReply(self._status, self._headers, body)
        self._buf.clear()
        self._done.set_result(reply)

    def _advance(self) -> None:
        if self._headers is None and not self._parse_head():
            return
        if self._chunked:
            self._read_chunks()
        elif self._length >= 0 and len(self._buf) >= self._length:
            if len(self._buf) > self._length:
                self.keep_alive = False  # more than the reply: do not reuse
                self._finish(bytes(self._buf[:self._length]))
            else:
                self._finish(bytes(self._buf))

    def _parse_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                raise WireError("reply head too long")
            return False
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[:end + 4]
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise WireError(f"not an HTTP/1.x reply: {lines[0][:100]!r}")
        status = int(code)
        if 100 <= status < 200:  # an interim reply (100 Continue): the real one follows
            return self._parse_head() if self._buf else False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        self._status, self._headers = status, headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = (connection != "close" if version == "HTTP/1.1"
                           else connection == "keep-alive")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked, self._length = True, -1
        elif "content-length" in headers:
            try:
                self._chunked, self._length = False, int(headers["content-length"])
            except ValueError:
                raise WireError("bad Content-Length") from None
        elif status in (204, 304):
            self._chunked, self._length = False, 0
        else:
            self._chunked, self._length, self.keep_alive = False, -1, False
        return True

    def _read_chunks(self) -> None:
        buf = self._buf
        while True:
            eol = buf.find(b"\r\n", self._pos)
            if eol < 0:
                return
            size_text = bytes(buf[self._pos:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise WireError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                # The last chunk; trailers (rare), if any, end with an empty line too.
                if buf.find(b"\r\n\r\n", eol) >= 0:
                    self._finish(b"".join(self._chunks))
                return
            start, stop = eol + 2, eol + 2 + size
            if len(buf) < stop + 2:
                return
            self._chunks.append(bytes(buf[start:stop]))
            self._pos = stop + 2


class WirePool:
    """Connections to one origin (`base_url`: http or https, optional path prefix)."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None,
                 connect_timeout_s: float = 10.0, max_idle: int = 1024,
                 idle_s: float = 4.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        if not base_url.isascii():  # the request line and Host header are ASCII
            raise ValueError(f"not an ASCII URL (write an internationalised host in its "
                             f"IDNA form, xn--..., and percent-encode the path): {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        host = parts.netloc.rpartition("@")[2]
        fixed = {"host": host, "accept": "*/*", "user-agent": "treadle",
                 **{k.lower(): v for k, v in (headers or {}).items()}}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle
        self._idle_s = idle_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._busy: set[_Connection] = set()
        self._closed = False

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeout_s: float | None = None) -> WireReply:
        """One exchange; `timeout_s` bounds connect + send + the whole reply."""
        if self._closed:
            raise WireError("the connection pool is closed")
        head = self._head(method, path, body, headers)
        if timeout_s is None:  # a generation: its caller bounds it (no timer per call)
            return await self._exchange(head, body)
        async with asyncio.timeout(timeout_s):
            return await self._exchange(head, body)

    async def _exchange(self, head: bytes, body: bytes | None) -> WireReply:
        for attempt in (0, 1):
            conn, reused = await self._take()
            self._busy.add(conn)
            ok = False
            try:
                reply = await conn.send(head, body)
                ok = True
            except WireError:
                if attempt == 0 and reused and conn.replied_nothing:
                    continue  # the server closed it while idle: once more, anew
                raise
            finally:
                self._busy.discard(conn)
                if ok and conn.keep_alive and not conn.closed:
                    self._put(conn)
                else:
                    conn.close()  # also on cancel: the server sees the disconnect
            return reply
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close every connection, idle or busy."""
        self._closed = True
        for conn in (*self._idle, *self._busy):
            conn.close()
        self._idle.clear()

    def _head(self, method: str, path: str, body: bytes | None,
              headers: Mapping[str, str] | None) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        length = f"content-length: {len(body)}\r\ncontent-type: application/json\r\n" \
            if body is not None else ("content-length: 0\r\n" if method == "POST" else "")
        return (f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._fixed}{extra}{length}"
                "\r\n").encode("latin-1")

    async def _take(self) -> tuple[_Connection, bool]:
        now = time.monotonic()
        idle = self._idle
        while idle and now - idle[0].idle_since > self._idle_s:  # oldest first: O(1) each
            idle.popleft().close()
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    _Connection, self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl else None)
        except OSError as e:
            raise WireError(f"cannot connect to {self._host}:{self._port}: {e}") from None
        return conn, False

    def _put(self, conn: _Connection) -> None:
        if self._closed or len(self._idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

"""What the HTTP engine clients share: transport, JSON codec, error mapping in one
place, timeouts, abort by cancel, Prometheus text parsing. Internal to treadle.engines.

The transport is `_wire.WirePool` (an O(1) keep-alive pool) and the codec msgspec
(typed decoding: fields a client does not read, such as the prompt ids vLLM echoes,
are skipped without building Python objects). `TREADLE_ENGINE_HTTP=httpx` selects
the previous stack instead, httpx with the standard library's json, so that a bench
can measure both in one run; so does passing an `httpx.AsyncClient` (`client=`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar
from urllib.parse import urlencode

import httpx
import msgspec

from treadle.engines._wire import WireError, WirePool, WireReply
from treadle.engines.base import Engine, GenerateRequest, GenerateResult
from treadle.engines.errors import (
    EngineError,
    EngineModelMissing,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    remember_address,
)

_T = TypeVar("_T")
log = logging.getLogger(__name__)
_HEALTH_TIMEOUT_S = 5.0
_ABORT_TIMEOUT_S = 5.0
_LOAD_TIMEOUT_S = 10.0
HTTP_STACK_ENV = "TREADLE_ENGINE_HTTP"  # "wire" (default) or "httpx" (the old stack)
_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


class Transport(Protocol):
    """One origin's connections. Raises WireError (cannot connect, reset, not HTTP) or
    TimeoutError (connect or `timeout_s`); any status comes back as a reply."""

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeout_s: float | None = None) -> WireReply: ...

    async def aclose(self) -> None: ...


class HttpxTransport:
    """`Transport` over an httpx.AsyncClient (the stack before `WirePool`)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeout_s: float | None = None) -> WireReply:
        sent = dict(headers or {})
        if body is not None:
            sent["content-type"] = "application/json"
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            reply = await self.client.request(method, path, content=body, headers=sent,
                                              **extra)
        except httpx.TimeoutException as e:
            raise TimeoutError(repr(e)) from None
        except httpx.HTTPError as e:
            raise WireError(repr(e)) from None
        return WireReply(reply.status_code, reply.headers, reply.content)

    async def aclose(self) -> None:
        await self.client.aclose()


def json_bytes(obj: Any) -> bytes:
    """`obj` as compact JSON (msgspec: a token-id list encodes some 20x faster than
    with the standard library)."""
    return _ENCODER.encode(obj)


def decode_json(raw: bytes, into: type[_T], what: str) -> _T:
    """`raw` decoded as `into` (a msgspec Struct, or Any); EngineProtocolError names
    the first bad field, or says the reply is not JSON."""
    decoder = _DECODERS.get(into)
    if decoder is None:
        decoder = _DECODERS[into] = msgspec.json.Decoder(into)
    try:
        return decoder.decode(raw)  # type: ignore[no-any-return]
    except msgspec.ValidationError as e:
        raise EngineProtocolError(f"{what}: {_field_message(e)}") from None
    except msgspec.DecodeError:
        raise EngineProtocolError(f"{what}: reply is not JSON: {raw[:200]!r}") from None


def convert(data: Any, into: type[_T], what: str) -> _T:
    """`data` (decoded JSON: dicts and lists) as `into`; errors as `decode_json`'s."""
    try:
        return msgspec.convert(data, into)
    except msgspec.ValidationError as e:
        raise EngineProtocolError(f"{what}: {_field_message(e)}") from None


def _field_message(error: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.a[0].b`" as "field 'a.0.b': ..."."""
    message, sep, at = str(error).rpartition(" - at `")
    where = at.rstrip("`").removeprefix("$").lstrip(".") if sep else ""
    if not sep:
        message = str(error)
    missing = re.match(r"Object missing required field `([^`]+)`", message)
    if missing:
        where = f"{where}.{missing.group(1)}" if where else missing.group(1)
    where = re.sub(r"\[(\d+)\]", r".\1", where).lstrip(".") or "(root)"
    return f"field {where!r}: {message}"


def parse_prometheus(text: str, names: Mapping[str, str]) -> dict[str, float]:
    """Sum the samples of each metric in `names` (metric name -> key) over all label
    sets (one per engine core or data-parallel rank). Metrics absent from `text` are
    absent from the result; a malformed value raises EngineProtocolError."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        key = names.get(line[:name_end])
        if key is None:
            continue
        # The value follows the label set (which may contain spaces inside quotes).
        rest = line[line.rfind("}") + 1:] if "{" in line[:name_end + 1] else line[name_end:]
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            raise EngineProtocolError(f"metric {line[:name_end]}: unreadable value "
                                      f"in {line[:200]!r}") from None
        if not math.isnan(value):
            out[key] = out.get(key, 0.0) + value
    return out


class HttpEngine(Engine):
    """Base of the HTTP clients: one `Transport`, in-flight tasks by request id.

    Subclasses implement `_call` (one request, its reply parsed into a result).
    `generate` runs `_call` in a task so that `abort` can cancel it: the HTTP
    connection closes, which is how vLLM learns to abort (it watches for the
    disconnect). Subclasses with an abort endpoint extend `abort`.
    """

    def __init__(self, base_url: str, *, client: httpx.AsyncClient | None = None,
                 headers: Mapping[str, str] | None = None,
                 connect_timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        # Sent with every call; kept so that another process can make the same client.
        self.headers: tuple[tuple[str, str], ...] = tuple(sorted((headers or {}).items()))
        remember_address(self.base_url)  # never shown in an answer to a client
        stack = os.environ.get(HTTP_STACK_ENV, "wire")
        self._legacy = client is not None or stack == "httpx"
        self._transport: Transport
        if client is not None:
            self._transport = HttpxTransport(client)
        elif stack == "httpx":
            # No read timeout: a long generation is normal; `timeout_s` bounds the call.
            self._transport = HttpxTransport(httpx.AsyncClient(
                base_url=self.base_url, headers=dict(headers or {}),
                timeout=httpx.Timeout(None, connect=connect_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)))
        else:
            self._transport = WirePool(self.base_url, headers=headers,
                                       connect_timeout_s=connect_timeout_s)
        self._inflight: dict[str, asyncio.Task[GenerateResult]] = {}
        self._aborted: set[str] = set()
        self._closed = False

    async def _call(self, request: GenerateRequest, started: float) -> GenerateResult:
        raise NotImplementedError

    def _aborted_result(self, request: GenerateRequest, started: float) -> GenerateResult:
        """The result of a request aborted by cancelling its HTTP call: no tokens known."""
        return GenerateResult(request.request_id, [], [], "abort", len(request.prompt_ids),
                              None, None, time.monotonic() - started)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._closed:
            raise EngineUnavailable(f"engine client for {self.base_url} is closed")
        if request.request_id in self._inflight:
            raise EngineRequestError(f"request id {request.request_id!r} is already in flight")
        started = time.monotonic()
        task = asyncio.ensure_future(self._call(request, started))
        self._inflight[request.request_id] = task
        try:
            async with asyncio.timeout(request.timeout_s):
                return await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise EngineTimeout(f"request {request.request_id!r} ran past its "
                                f"{request.timeout_s}s timeout") from None
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # our caller cancelled us
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            if request.request_id in self._aborted:  # abort() cancelled the call
                return self._aborted_result(request, started)
            raise
        finally:
            self._inflight.pop(request.request_id, None)
            self._aborted.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        task = self._inflight.get(request_id)
        if task is None or task.done():
            return
        self._aborted.add(request_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _abort_by_endpoint(self, request_id: str, path: str, body: dict[str, Any],
                                 grace_s: float) -> None:
        """Abort through the engine's own endpoint, so the pending call returns the
        tokens so far; drop the connection if it has not returned after `grace_s`."""
        task = self._inflight.get(request_id)
        if task is None or task.done():
            return
        with contextlib.suppress(EngineError, TimeoutError):
            await self._request("POST", path, body, timeout_s=_ABORT_TIMEOUT_S)
        await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            await HttpEngine.abort(self, request_id)

    async def _max_model_len(self, model: str | None) -> int | None:
        """`max_model_len` of the served model named `model` (or of the first, when
        None) in `/v1/models`, as vLLM and SGLang list it; None where not given."""
        try:
            listed = await self._get_json("/v1/models", Any, _LOAD_TIMEOUT_S)
        except EngineError:
            return None
        entries = listed.get("data") if isinstance(listed, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and (model is None or entry.get("id") == model):
                value = entry.get("max_model_len")
                return value if type(value) is int and value > 0 else None
        return None

    async def health(self) -> bool:
        try:
            reply = await self._transport.request("GET", "/health",
                                                  timeout_s=_HEALTH_TIMEOUT_S)
        except (WireError, TimeoutError):
            return False
        return reply.status == 200

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._transport.aclose()

    async def _post_json(self, path: str, body: Mapping[str, Any], into: type[_T],
                         headers: Mapping[str, str] | None = None) -> _T:
        """POST `body` as JSON; the reply decoded as `into` (see `decode_json`)."""
        reply = await self._request("POST", path, body, headers=headers)
        return self._decode(reply.body, into, path)

    async def _get_json(self, path: str, into: type[_T],
                        timeout_s: float | None = None) -> _T:
        reply = await self._request("GET", path, timeout_s=timeout_s)
        return self._decode(reply.body, into, path)

    async def _get_text(self, path: str) -> str:
        return (await self._request("GET", path, timeout_s=_LOAD_TIMEOUT_S)).text

    def _decode(self, raw: bytes, into: type[_T], path: str) -> _T:
        what = f"{self.base_url}{path} reply"
        if self._legacy:  # the old stack's codec, for side-by-side measurement
            try:
                data = json.loads(raw)
            except ValueError:
                raise EngineProtocolError(f"{what}: reply is not JSON: {raw[:200]!r}") \
                    from None
            return convert(data, into, what)
        return decode_json(raw, into, what)

    async def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None,
                       *, headers: Mapping[str, str] | None = None,
                       params: Mapping[str, str] | None = None,
                       timeout_s: float | None = None) -> WireReply:
        """One exchange, its failures as EngineErrors (the one place they are mapped):
        unreachable, reset or timed out: EngineUnavailable; 404 naming the model:
        EngineModelMissing; other 4xx: EngineRequestError; not 200: EngineUnavailable."""
        if params:
            path = f"{path}?{urlencode(params)}"
        raw = None
        if body is not None:
            raw = json.dumps(body).encode() if self._legacy else _ENCODER.encode(body)
        try:
            reply = await self._transport.request(method, path, raw, headers, timeout_s)
        except TimeoutError as e:
            raise EngineUnavailable(f"{self.base_url}: timed out ({e!r})") from None
        except WireError as e:
            raise EngineUnavailable(f"{self.base_url}: {e}") from None
        status = reply.status
        if status == 200:
            return reply
        if method == "POST":
            # A call the engine refused or failed, logged whole with the engine's
            # address, which answers to clients never show (`errors.public_text`).
            # (A failed poll of /metrics or /health is its poller's to report.)
            log.warning("engine %s answered %d to POST %s: %s", self.base_url, status, path,
                        reply.text[:300])
        if status == 404 and self._model_missing(reply):
            raise EngineModelMissing(f"{self.base_url} does not serve the model: "
                                     f"{reply.text[:300]}")
        if 400 <= status < 500:
            raise EngineRequestError(f"{self.base_url} rejected the request "
                                     f"({status}): {reply.text[:1000]}")
        raise EngineUnavailable(f"{self.base_url} failed ({status}): {reply.text[:1000]}")

    def _model_missing(self, reply: WireReply) -> bool:
        """Whether a 404 says the model is unknown (engines that name models say so)."""
        return False

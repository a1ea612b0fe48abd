"""What the HTTP engine clients share: error mapping, timeouts, abort by cancel,
Prometheus text parsing. Internal to treadle.engines."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from treadle.engines.base import Engine, GenerateRequest, GenerateResult
from treadle.engines.errors import (
    EngineError,
    EngineModelMissing,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)

_M = TypeVar("_M", bound=BaseModel)
_HEALTH_TIMEOUT_S = 5.0
_ABORT_TIMEOUT_S = 5.0
_LOAD_TIMEOUT_S = 10.0


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


def validate(model: type[_M], data: Any, what: str) -> _M:
    """`data` as `model`, or EngineProtocolError naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "(root)"
        raise EngineProtocolError(f"{what}: field {where!r}: {err['msg']}") from None


class HttpEngine(Engine):
    """Base of the HTTP clients: one httpx.AsyncClient, in-flight tasks by request id.

    Subclasses implement `_call` (one request, its reply parsed into a result).
    `generate` runs `_call` in a task so that `abort` can cancel it: the HTTP
    connection closes, which is how vLLM learns to abort (it watches for the
    disconnect). Subclasses with an abort endpoint extend `abort`.
    """

    def __init__(self, base_url: str, *, client: httpx.AsyncClient | None = None,
                 headers: Mapping[str, str] | None = None,
                 connect_timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        # No read timeout: a long generation is normal; `timeout_s` bounds the whole call.
        self._client = client or httpx.AsyncClient(
            base_url=self.base_url, headers=dict(headers or {}),
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
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
            await asyncio.wait_for(self._raw(lambda: self._client.post(path, json=body)),
                                   _ABORT_TIMEOUT_S)
        await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            await HttpEngine.abort(self, request_id)

    async def health(self) -> bool:
        try:
            reply = await self._client.get("/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    async def _post_json(self, path: str, body: Mapping[str, Any],
                         headers: Mapping[str, str] | None = None) -> Any:
        return await self._send(lambda: self._client.post(path, json=dict(body),
                                                          headers=headers))

    async def _get_text(self, path: str) -> str:
        reply = await self._raw(lambda: self._client.get(path, timeout=_LOAD_TIMEOUT_S))
        return reply.text

    async def _raw(self, send: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        try:
            reply = await send()
        except httpx.TimeoutException as e:
            raise EngineUnavailable(f"{self.base_url}: timed out ({e!r})") from None
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"{self.base_url}: {e!r}") from None
        if reply.status_code == 404 and self._model_missing(reply):
            raise EngineModelMissing(f"{self.base_url} does not serve the model: "
                                     f"{reply.text[:300]}")
        if 400 <= reply.status_code < 500:
            raise EngineRequestError(f"{self.base_url} rejected the request "
                                     f"({reply.status_code}): {reply.text[:1000]}")
        if reply.status_code != 200:
            raise EngineUnavailable(f"{self.base_url} failed ({reply.status_code}): "
                                    f"{reply.text[:1000]}")
        return reply

    def _model_missing(self, reply: httpx.Response) -> bool:
        """Whether a 404 says the model is unknown (engines that name models say so)."""
        return False

    async def _send(self, send: Callable[[], Awaitable[httpx.Response]]) -> Any:
        reply = await self._raw(send)
        try:
            return reply.json()
        except ValueError:
            raise EngineProtocolError(f"{self.base_url}: reply is not JSON: "
                                      f"{reply.text[:200]!r}") from None

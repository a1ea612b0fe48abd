"""HTTP front of the emulated engine: the subset of vLLM's API that treadle uses.

    treadle engine emulate --port 8000 --model qwen3-14b --gpu h100 --tp 2 --time-scale 0.05

Endpoints (vLLM's shapes, so `VLLMEngine` drives it unchanged):

- `POST /v1/completions`: `prompt` a token-id list (no tokenizer here: text is a
  400), `max_tokens`, `temperature`/`top_p` (accepted, not used), `logprobs`,
  `stop_token_ids`, `priority`, `request_id` (or the `X-Request-Id` header),
  `return_token_ids`; `n` must be 1 and `stream` false; structured output
  (`structured_outputs`, `response_format`) is a 400: it has no grammar, and a
  constraint ignored would fake the output. The reply's `model` is the served name,
  `<model>-emulated`, and `text` is empty. `usage.prompt_tokens_details
  .cached_tokens` is always reported; a non-vLLM `treadle_timing{queued_s,
  generating_s}` field carries the emulated split. A client that disconnects aborts
  its request (as in vLLM).
- `GET /metrics`: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total`, `vllm:generation_tokens_total`; and its own
  `treadle:generation_tokens_in_flight` (tokens of requests still running).
- `GET /health`, `GET /v1/models`; and, not in vLLM, `POST /abort_request
  {"request_id"}` ending a request with its tokens so far (its caller gets them).
- vLLM's RL endpoints (`POST /pause?mode=abort|wait|keep`, `/resume`,
  `/collective_rpc` with `reload_weights`, `/update_weight_version`, `GET
  /weight_info`), so a weight update runs against the emulator as against vLLM in
  dev mode, pause modes included (`EmulatedEngine.pause`); it has no weights, so
  reloading only takes the engine's `load_s`. `clear_cache` is accepted and ignored
  (KV is keyed by `cache_salt`). Unlike vLLM's /v1/completions, a reply carries
  `weight_versions` (vLLM's spans, as its /inference/v1/generate reports them):
  which weights sampled which output tokens.

Bad requests get 400 (422 never: validation errors are reported as 400, as vLLM
does) with `{"error": {"message", "type", "code"}}`; an unknown model gets 404.
No auth, no TLS: bind to loopback or a trusted network.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treadle.engines.base import GenerateResult, PauseMode
from treadle.engines.emulated import EmulatedEngine
from treadle.served import loopback_socket, serving_in_thread


class CompletionRequest(BaseModel):
    """The `/v1/completions` fields the emulator reads; others are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    logprobs: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    priority: int = 0
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    return_token_ids: bool = False
    n: int = 1
    stream: bool = False
    # Read only to be refused (no grammar here).
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=128)


class RpcRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    method: str
    kwargs: dict[str, Any] = Field(default_factory=dict)


class VersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new_version: str


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str


_PAUSE_MODES: dict[str, PauseMode] = {"abort": "abort", "wait": "drain", "keep": "keep"}
_M = TypeVar("_M", bound=BaseModel)
_ENCODER = msgspec.json.Encoder()


async def _body(model: type[_M], request: Request) -> _M | Response:
    """The request's body as `model`, or the 400 reply saying which field is wrong."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        return _error(400, f"invalid {model.__name__}: {e.errors(include_url=False)!r:.500}")


def _error(status: int, message: str) -> Response:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def _prompt_ids(body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, str):
        raise ValueError("the emulated engine has no tokenizer: send `prompt` as a list "
                         "of token ids")
    if prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise ValueError("one prompt per request (a batch of prompts is not emulated)")
        return list(prompt[0])
    return list(prompt)  # type: ignore[arg-type]


def _reply(result: GenerateResult, body: CompletionRequest, served: str,
           prompt: list[int]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": result.finish_reason,
                              "stop_reason": None, "logprobs": None}
    if body.logprobs is not None:
        tokens = [f"token_id:{t}" for t in result.output_ids]
        choice["logprobs"] = {
            "tokens": tokens, "token_logprobs": result.logprobs,
            "top_logprobs": ([{t: lp} for t, lp in zip(tokens, result.logprobs, strict=True)]
                             if body.logprobs else [None] * len(tokens)),
            "text_offset": [0] * len(tokens),
        }
    if body.return_token_ids:
        choice["token_ids"] = result.output_ids
        choice["prompt_token_ids"] = prompt
    return {
        "id": f"cmpl-{result.request_id}", "object": "text_completion",
        "created": int(time.time()), "model": served, "choices": [choice],
        "usage": {"prompt_tokens": result.prompt_tokens,
                  "completion_tokens": len(result.output_ids),
                  "total_tokens": result.prompt_tokens + len(result.output_ids),
                  "prompt_tokens_details": {"cached_tokens": result.cached_tokens}},
        "treadle_timing": {"queued_s": result.queued_s, "generating_s": result.generating_s},
        "weight_versions": [{"version": s.version, "start": s.start, "end": s.end}
                            for s in result.version_spans],
    }


def create_app(engine: EmulatedEngine, served_model: str) -> FastAPI:
    """The ASGI app; its lifespan starts the engine loop and stops it (aborting all)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="treadle emulated engine", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, exc: RequestValidationError) -> Response:
        return _error(400, f"invalid request: {exc.errors()!r:.500}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": served_model, "object": "model", "owned_by": "treadle",
             "max_model_len": engine.max_model_len}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        load = engine.load()
        label = f'{{model_name="{served_model}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {load.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {load.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {load.kv_usage:.6f}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{label} {engine.prefix_queries}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{label} {engine.prefix_hits}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {engine.generated}",
            # The emulator's own: tokens of requests still running (not in the total
            # until they end), what a client that dies now throws away.
            "# TYPE treadle:generation_tokens_in_flight gauge",
            f"treadle:generation_tokens_in_flight{label} {engine.generating}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    # vLLM's RL endpoints (served with VLLM_SERVER_DEV_MODE=1), so that a weight update
    # runs against the emulator as against vLLM, its pause modes included.
    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> Response:
        del clear_cache  # KV is keyed by the requests' cache_salt
        if mode not in _PAUSE_MODES:
            return _error(400, f"Invalid pause mode: {mode}")
        await engine.pause(_PAUSE_MODES[mode])
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> Response:
        engine.resume()
        return JSONResponse({"status": "resumed"})

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Response:
        body = await _body(RpcRequest, request)
        if isinstance(body, Response):
            return body
        if body.method != "reload_weights":
            return _error(400, f"the emulated engine has no method {body.method!r}")
        await engine.reload()
        return JSONResponse({"results": [None]})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await _body(VersionRequest, request)
        if isinstance(body, Response):
            return body
        engine.label_weights(body.new_version)
        return JSONResponse({"success": True, "new_version": body.new_version})

    @app.get("/weight_info")
    async def weight_info() -> Response:
        return JSONResponse({"weight_version": engine.weight_version})

    @app.post("/abort_request")
    async def abort(request: Request) -> Response:
        body = await _body(AbortRequest, request)
        if isinstance(body, Response):
            return body
        return JSONResponse({"aborted": engine.abort(body.request_id)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(CompletionRequest, request)
        if isinstance(body, Response):
            return body
        if body.model is not None and body.model != served_model:
            return _error(404, f"The model `{body.model}` does not exist; this server "
                               f"serves `{served_model}`")
        if body.n != 1 or body.stream:
            return _error(400, "n must be 1 and stream false on the emulated engine")
        if body.structured_outputs is not None or (
                body.response_format is not None
                and body.response_format.get("type") != "text"):
            return _error(400, "the emulated engine decodes under no structured-output "
                               "constraint (structured_outputs, response_format)")
        request_id = (body.request_id or request.headers.get("x-request-id")
                      or uuid.uuid4().hex)
        try:
            prompt = _prompt_ids(body)
            done = engine.submit(request_id, prompt, body.max_tokens, priority=body.priority,
                                 stop_token_ids=body.stop_token_ids,
                                 cache_salt=body.cache_salt)
        except ValueError as e:
            return _error(400, str(e))
        result = await _unless_disconnected(request, done)
        if result is None:  # the client is gone: free its slot, as vLLM does
            engine.abort(request_id)
            return Response(status_code=499)
        # msgspec: the reply echoes the prompt's ids (as vLLM's does), which the standard
        # library's json encodes some 20x slower, on the cores the service shares.
        return Response(_ENCODER.encode(_reply(result, body, served_model, prompt)),
                        media_type="application/json")

    return app


async def _unless_disconnected(request: Request,
                               done: asyncio.Future[GenerateResult]) -> GenerateResult | None:
    """The result, or None if the client disconnects first."""
    gone = asyncio.ensure_future(_disconnect(request))
    waiting: set[asyncio.Future[Any]] = {done, gone}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
    return done.result() if done.done() else None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _server(engine: EmulatedEngine, served_model: str, host: str, port: int,
            log_level: str) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(
        create_app(engine, served_model), host=host, port=port, log_level=log_level,
        access_log=False, lifespan="on", http="h11", loop="asyncio", ws="none",
        timeout_graceful_shutdown=5, server_header=False))


async def serve(engine: EmulatedEngine, served_model: str, *, host: str = "127.0.0.1",
                port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; unfinished requests end with finish "abort"."""
    await _server(engine, served_model, host, port, log_level).serve()


@dataclass(frozen=True, slots=True)
class RunningEngine:
    """A server started by `serve_in_thread`."""

    url: str  # http://127.0.0.1:<port>
    model: str  # the served model name
    engine: EmulatedEngine  # lives in the server's thread and loop: read, do not call


@contextlib.contextmanager
def serve_in_thread(engine: EmulatedEngine, served_model: str, *,
                    startup_timeout_s: float = 30.0) -> Iterator[RunningEngine]:
    """The server on 127.0.0.1 (a free port) in a thread of this process, for tests.

    On exit it shuts down and the thread is joined; RuntimeError if it does not start.
    """
    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = _server(engine, served_model, "127.0.0.1", port, "warning")
    with serving_in_thread(server, sock, name=f"emulated-engine-{port}",
                           startup_timeout_s=startup_timeout_s):
        yield RunningEngine(f"http://127.0.0.1:{port}", served_model, engine)

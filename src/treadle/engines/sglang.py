"""Client for SGLang's native server API: `POST /generate` with `input_ids`.

    engine = SGLangEngine("http://127.0.0.1:30000")
    result = await engine.generate(GenerateRequest("t1-turn0", prompt_ids, max_tokens=512))

Wire format (SGLang's documented native API): the request carries `input_ids`,
`sampling_params{max_new_tokens, temperature, top_p, stop_token_ids, sampling_seed}`,
`return_logprob`, `rid` (the request id) and `priority`; the reply carries
`output_ids` and `meta_info{prompt_tokens, cached_tokens, finish_reason{type},
output_token_logprobs: [[logprob, token_id, text], ...]}`. The logprob entries'
token ids must match `output_ids` (checked). A request's `constraint` goes in
`sampling_params.json_schema` (SGLang's documented field: the schema as a JSON
string; any JSON object is the schema `{"type": "object"}`, as SGLang's own OpenAI
server sends `json_object`), decoded under the server's grammar backend
(`--grammar-backend`, xgrammar by default).

`abort` posts `/abort_request {"rid"}`: SGLang then ends the pending `/generate`
with finish type "abort" and the output so far, which `generate` returns. If the
engine does not answer within `abort_grace_s` (unreachable, or the abort overtook
the request), the HTTP call is cancelled instead and the result has no tokens.
Load comes from `/metrics` (`sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage`; the server needs `--enable-metrics`). `priority` needs
`--enable-priority-scheduling`. `queued_s` is None; `generating_s` is the wall time,
or `meta_info.e2e_latency` when reported.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import msgspec

from treadle.engines._http import HttpEngine, convert, parse_prometheus
from treadle.engines.base import (
    EngineCapabilities,
    EngineLoad,
    FinishReason,
    GenerateRequest,
    GenerateResult,
)
from treadle.engines.errors import EngineProtocolError
from treadle.types import (
    ConstraintKind,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    OutputConstraint,
)

_METRICS = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv",
}


class FinishInfo(msgspec.Struct, frozen=True):
    type: FinishReason


class MetaInfo(msgspec.Struct, frozen=True):
    prompt_tokens: int
    finish_reason: FinishInfo | None
    cached_tokens: int | None = None
    # [[logprob, token_id, token_text_or_null], ...]
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    e2e_latency: float | None = None


class GenerateReply(msgspec.Struct, frozen=True):  # unknown fields: skipped by the decoder
    output_ids: list[int]
    meta_info: MetaInfo


def generate_body(request: GenerateRequest) -> dict[str, Any]:
    """The `/generate` body for one request."""
    params: dict[str, Any] = {
        "max_new_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "skip_special_tokens": False,
    }
    if request.stop_token_ids:
        params["stop_token_ids"] = list(request.stop_token_ids)
    if request.seed is not None:
        # SGLang keeps sampling seeds as int32 (and reads them only when the server
        # runs with --enable-deterministic-inference): 31 bits of ours.
        params["sampling_seed"] = request.seed & 0x7FFF_FFFF
    if request.constraint is not None:
        params["json_schema"] = json_schema_text(request.constraint)
    body: dict[str, Any] = {
        "input_ids": request.prompt_ids,
        "sampling_params": params,
        "return_logprob": request.logprobs,
        "rid": request.request_id,
        "stream": False,
    }
    if request.priority:
        body["priority"] = request.priority
    return body


def json_schema_text(constraint: OutputConstraint) -> str:
    """SGLang's `sampling_params.json_schema` for `constraint`."""
    match constraint:
        case JsonSchemaConstraint(schema=schema):
            return json.dumps(schema)
        case JsonObjectConstraint():
            return '{"type": "object"}'


def parse_generate(data: GenerateReply | Any, request: GenerateRequest,
                   elapsed_s: float) -> GenerateResult:
    """A `/generate` reply (decoded, or as plain JSON data) as a result;
    EngineProtocolError names a bad field."""
    reply = data if isinstance(data, GenerateReply) else convert(
        data, GenerateReply, "/generate reply")
    meta = reply.meta_info
    if meta.finish_reason is None:
        raise EngineProtocolError("/generate reply: field 'meta_info.finish_reason' is null "
                                  "(the request did not finish)")
    finish = meta.finish_reason.type
    logprobs: list[float] = []
    if request.logprobs:
        entries = meta.output_token_logprobs
        if entries is None:
            raise EngineProtocolError("/generate reply: field 'meta_info.output_token_logprobs'"
                                      " is missing although return_logprob was set")
        if [e[1] for e in entries] != reply.output_ids or any(e[0] is None for e in entries):
            raise EngineProtocolError("/generate reply: field 'meta_info.output_token_logprobs'"
                                      " does not match 'output_ids' (ids or null logprobs)")
        logprobs = [float(e[0]) for e in entries if e[0] is not None]
    return GenerateResult(
        request_id=request.request_id, output_ids=reply.output_ids, logprobs=logprobs,
        finish_reason=finish, prompt_tokens=meta.prompt_tokens,
        cached_tokens=meta.cached_tokens, queued_s=None,
        generating_s=meta.e2e_latency if meta.e2e_latency is not None else elapsed_s)


class SGLangEngine(HttpEngine):
    """One SGLang server (`python -m sglang.launch_server`). `api_key`: `--api-key`."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 client: httpx.AsyncClient | None = None, connect_timeout_s: float = 10.0,
                 abort_grace_s: float = 2.0) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(base_url, client=client, headers=headers,
                         connect_timeout_s=connect_timeout_s)
        self.abort_grace_s = abort_grace_s

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(constraints=frozenset(ConstraintKind))  # its grammars

    async def context_window(self) -> int | None:
        """The served model's `max_model_len` (`GET /v1/models`; SGLang serves one)."""
        return await self._max_model_len(None)

    async def _call(self, request: GenerateRequest, started: float) -> GenerateResult:
        data = await self._post_json("/generate", generate_body(request), GenerateReply)
        return parse_generate(data, request, time.monotonic() - started)

    async def abort(self, request_id: str) -> None:
        # SGLang's own abort returns the tokens so far through the pending call.
        await self._abort_by_endpoint(request_id, "/abort_request", {"rid": request_id},
                                      self.abort_grace_s)

    async def load(self) -> EngineLoad:
        values = parse_prometheus(await self._get_text("/metrics"), _METRICS)
        missing = [name for name, key in _METRICS.items() if key not in values]
        if missing:
            raise EngineProtocolError(f"/metrics: field {missing[0]!r} is missing "
                                      "(is the server run with --enable-metrics?)")
        return EngineLoad(int(values["running"]), int(values["waiting"]), values["kv"])

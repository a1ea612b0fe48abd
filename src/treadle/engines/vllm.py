"""Client for vLLM's OpenAI-compatible server: `POST /v1/completions` with token ids.

    engine = VLLMEngine("http://127.0.0.1:8000", model="Qwen/Qwen3-8B")
    result = await engine.generate(GenerateRequest("t1-turn0", prompt_ids, max_tokens=512))

The request sends the prompt as a token-id list with `return_token_ids: true` (vLLM
≥ 0.10.2) and `logprobs: 1`, so output ids and logprobs come back as the engine
sampled them: nothing is re-tokenized. With `return_token_ids` vLLM also echoes the
whole prompt (`prompt_token_ids`; it has no option to leave that out, as of 0.32);
the reply is decoded straight into the structs below (msgspec), which skips fields
the client does not read without building them, so the echo costs a scan, not a
list of thousands of ints. Older replies that carry `token_ids` per
choice without being asked are read the same way; a reply without output token ids
is an EngineProtocolError (text cannot be turned back into ids faithfully).

The request id goes in the `X-Request-Id` header and the body's `request_id`
(vLLM prefixes it, e.g. `cmpl-<id>`). `priority` only matters when the server runs
with `--scheduling-policy priority` (lower first); other servers reject a non-zero
priority with a 400 (EngineRequestError). A request's `seed` goes in the body's
`seed` (vLLM samples that request from its own generator). A request's `constraint`
goes in the body's `structured_outputs` (vLLM's own field, ≥ 0.10.2: `{"json":
schema}` or `{"json_object": true}`), which vLLM compiles into a grammar (its
default backend, xgrammar on 0.32) masking every step's logits to the tokens the
constraint allows; `logprobs` are then those of the masked distribution, as vLLM
reports them. A schema its backend cannot compile is a 400 (EngineRequestError).

With `tokens_api=True` the calls go to vLLM's token-in token-out API instead
(`vllm_tokens`: a server started with `--enable-scale-out`), whose replies say which
weights sampled each token, so the client declares the "keep" pause mode.

Limits: non-streaming. `abort` closes the HTTP connection, which vLLM turns into an
engine-side abort, so an aborted result carries no tokens (the partial output never
reaches the client). `cached_tokens` is reported only when the server runs with
`--enable-prompt-tokens-details`; else None. `queued_s` is None (vLLM does not
report it per request); `generating_s` is the call's wall time. Load comes from
`/metrics` (vLLM ≥ 0.10 names `vllm:kv_cache_usage_perc`, older ones
`vllm:gpu_cache_usage_perc`; both are fractions 0-1 despite the name).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any, cast

import httpx
import msgspec

from treadle.engines._http import HttpEngine, convert, parse_prometheus
from treadle.engines._wire import WireReply
from treadle.engines.base import (
    EngineCapabilities,
    EngineLoad,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    VersionSpan,
)
from treadle.engines.errors import EngineError, EngineProtocolError, EngineRequestError
from treadle.engines.vllm_tokens import (
    GENERATE_PATH,
    TokensReply,
    generate_body,
    parse_tokens_reply,
)
from treadle.types import (
    ConstraintKind,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    OutputConstraint,
)

_MODELS_TIMEOUT_S = 10.0
_VLLM_PAUSE: dict[PauseMode, str] = {"abort": "abort", "drain": "wait", "keep": "keep"}
# What vLLM decodes under (its structured outputs).
STRUCTURED = frozenset(ConstraintKind)

_METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_old",
}


class Logprobs(msgspec.Struct, frozen=True):
    token_logprobs: list[float | None]


class Choice(msgspec.Struct, frozen=True):
    """What the client reads of a choice. Unknown fields are skipped by the decoder
    unbuilt: `prompt_token_ids` (the whole prompt, which vLLM echoes with
    `return_token_ids` and has no option to leave out) is one; `usage.prompt_tokens`
    carries its length."""

    finish_reason: FinishReason | None
    index: int = 0
    token_ids: list[int] | None = None  # with return_token_ids (vLLM ≥ 0.10.2)
    logprobs: Logprobs | None = None


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None


class WeightVersionSpan(msgspec.Struct, frozen=True):
    """vLLM's `WeightVersionSpan` (its /inference/v1/generate reports them; its
    /v1/completions does not): output tokens [start, end) came from `version`."""

    version: str | None
    start: int
    end: int


class CompletionReply(msgspec.Struct, frozen=True):
    choices: list[Choice]
    id: str | None = None
    model: str | None = None
    usage: Usage | None = None
    # Not vLLM: the emulated engine's timing split, read when present.
    treadle_timing: dict[str, float | None] | None = None
    # Not vLLM's /v1/completions: the emulated engine's per-token weight versions.
    weight_versions: list[WeightVersionSpan] | None = None


def completion_body(request: GenerateRequest, model: str) -> dict[str, Any]:
    """The `/v1/completions` body for one request (also what the emulator reads)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt_ids,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "return_token_ids": True,
        "request_id": request.request_id,
        "skip_special_tokens": False,
    }
    if request.logprobs:
        body["logprobs"] = 1  # top-1 alternatives; the sampled token's logprob is always in
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.priority:
        body["priority"] = request.priority
    if request.seed is not None:
        body["seed"] = request.seed
    if request.constraint is not None:
        body["structured_outputs"] = structured_outputs(request.constraint)
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body


def structured_outputs(constraint: OutputConstraint) -> dict[str, Any]:
    """vLLM's `structured_outputs` for `constraint` (`StructuredOutputsParams`)."""
    match constraint:
        case JsonSchemaConstraint(schema=schema):
            return {"json": dict(schema)}
        case JsonObjectConstraint():
            return {"json_object": True}


def parse_completion(data: CompletionReply | Any, request: GenerateRequest,
                     elapsed_s: float) -> GenerateResult:
    """A `/v1/completions` reply (decoded, or as plain JSON data) as a result;
    EngineProtocolError names a bad field."""
    reply = data if isinstance(data, CompletionReply) else convert(
        data, CompletionReply, "/v1/completions reply")
    if len(reply.choices) != 1:
        raise EngineProtocolError(f"/v1/completions reply: field 'choices': expected 1 "
                                  f"choice, got {len(reply.choices)}")
    choice = reply.choices[0]
    if choice.token_ids is None:
        raise EngineProtocolError("/v1/completions reply: field 'choices.0.token_ids' is "
                                  "missing (vLLM < 0.10.2 ignores return_token_ids)")
    finish = choice.finish_reason
    if finish is None:
        raise EngineProtocolError("/v1/completions reply: field 'choices.0.finish_reason' "
                                  "is null (the request did not finish)")
    logprobs: list[float] = []
    if request.logprobs:
        if choice.logprobs is None:
            raise EngineProtocolError("/v1/completions reply: field 'choices.0.logprobs' is "
                                      "missing although logprobs were requested")
        values = choice.logprobs.token_logprobs
        if len(values) != len(choice.token_ids) or any(v is None for v in values):
            raise EngineProtocolError(
                "/v1/completions reply: field 'choices.0.logprobs.token_logprobs': "
                f"{len(values)} values (or nulls) for {len(choice.token_ids)} tokens")
        logprobs = cast(list[float], values)  # no None in it: checked above
    usage = reply.usage
    details = usage.prompt_tokens_details if usage is not None else None
    timing = reply.treadle_timing or {}
    generating = timing.get("generating_s")
    spans = tuple(VersionSpan(s.version, s.start, s.end) for s in reply.weight_versions or ())
    if spans and (spans[0].start != 0 or spans[-1].end != len(choice.token_ids) or any(
            a.end != b.start for a, b in itertools.pairwise(spans))):
        raise EngineProtocolError("/v1/completions reply: field 'weight_versions' does not "
                                  f"cover the {len(choice.token_ids)} output tokens in order")
    return GenerateResult(
        request_id=request.request_id, output_ids=choice.token_ids, logprobs=logprobs,
        finish_reason=finish,
        # Without `usage` (older servers) the prompt is what was sent, which is what
        # its echo would say.
        prompt_tokens=usage.prompt_tokens if usage is not None else len(request.prompt_ids),
        cached_tokens=details.cached_tokens if details is not None else None,
        queued_s=timing.get("queued_s"),
        generating_s=generating if generating is not None else elapsed_s,
        version_spans=spans)


class VLLMEngine(HttpEngine):
    """One vLLM server (`vllm serve` / `vllm.entrypoints.openai.api_server`).

    `model` must be the served model name (`--served-model-name`, else the path).
    `api_key` is sent as a bearer token (`--api-key`).
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 client: httpx.AsyncClient | None = None,
                 connect_timeout_s: float = 10.0, tokens_api: bool = False) -> None:
        headers: Mapping[str, str] = {"authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(base_url, client=client, headers=headers,
                         connect_timeout_s=connect_timeout_s)
        self.model = model
        # The token-in token-out API (`vllm_tokens`, a server started with
        # --enable-scale-out) says which weights sampled each token: "keep" with it.
        self.tokens_api = tokens_api
        if tokens_api:
            self.pause_modes = self.pause_modes | {"keep"}

    async def model_problem(self) -> str | None:
        try:
            listed = (await self._get_json("/v1/models", dict[str, Any],
                                           _MODELS_TIMEOUT_S)).get("data", [])
            served = sorted(str(m.get("id")) for m in listed if isinstance(m, dict))
        except (EngineError, AttributeError):
            return None  # cannot tell: the health check decides
        if self.model in served:
            return None
        return (f"the engine at {self.base_url} serves {', '.join(served) or 'no model'}, "
                f"not {self.model!r}")

    async def context_window(self) -> int | None:
        """The served model's `max_model_len` (`GET /v1/models`)."""
        return await self._max_model_len(self.model)

    def _model_missing(self, reply: WireReply) -> bool:
        # vLLM: {"error": {"message": "The model `x` does not exist.", "code": 404}}
        return "does not exist" in reply.text[:1000]

    async def _call(self, request: GenerateRequest, started: float) -> GenerateResult:
        if self.tokens_api:
            structured = (structured_outputs(request.constraint)
                          if request.constraint is not None else None)
            reply = await self._post_json(
                GENERATE_PATH, generate_body(request, self.model, structured), TokensReply,
                headers={"x-request-id": request.request_id})
            return parse_tokens_reply(reply, request, time.monotonic() - started)
        data = await self._post_json("/v1/completions", completion_body(request, self.model),
                                     CompletionReply,
                                     headers={"x-request-id": request.request_id})
        return parse_completion(data, request, time.monotonic() - started)

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(weight_updates=True, constraints=STRUCTURED,
                                  pause_modes=self.pause_modes)

    # vLLM 0.32 can also pause with "keep" (it freezes requests and resumes them under
    # the new weights), but its /v1/completions reply does not say which tokens came
    # from which weights (only /inference/v1/generate reports `weight_versions`), so
    # "keep" is declared only with `tokens_api`: else the runtime aborts or drains.
    pause_modes: frozenset[PauseMode] = frozenset({"abort", "drain"})

    async def update_weights(self, weights_path: str, version: int,
                             mode: PauseMode = "drain", *, recompute_kept: bool = True) -> None:
        """Load new weights from `weights_path` (safetensors saved by the trainer, on a
        file system the server reads) and label them `version`.

        Uses the RL endpoints vLLM serves with ``VLLM_SERVER_DEV_MODE=1``: pause (its
        in-flight requests finish first with "drain", are aborted with "abort", are
        frozen with "keep"), ``collective_rpc reload_weights``,
        ``update_weight_version``, resume. A server without them answers 404:
        EngineRequestError. The caller should have stopped sending requests first
        (`Runtime.pause`).

        The prefix cache is kept (``clear_cache=false``): cached KV is keyed by the
        requests' `cache_salt`, which treadle sets from the policy version, so KV of
        the old weights serves only requests that ask for it (a trajectory whose job
        keeps its KV across updates). vLLM's own default, ``clear_cache=true``, drops
        it all and, with "keep", also preempts the frozen requests (their KV is
        recomputed under the new weights when they resume): with "keep" and
        `recompute_kept` (a call in flight wants its KV of the new weights), treadle
        asks for that, and the whole prefix cache goes with it. A caller that sends
        requests without a `cache_salt` after an update (the runtime always sets one)
        may be served KV of the old weights.

        Known limit, vLLM's CPU build 0.32: a model with ``tie_word_embeddings``
        reloads into wrong logprobs (its output projection keeps a stale packed copy of
        the old weights); untie the embeddings of a model you update in place. Compare
        the engine's logprobs with the trainer's after an update to catch such drift.
        """
        if mode not in self.pause_modes:
            raise EngineRequestError(f"{type(self).__name__} cannot pause with {mode!r}")
        clear = mode == "keep" and recompute_kept
        await self._post_empty("/pause", params={"mode": _VLLM_PAUSE[mode],
                                                 "clear_cache": "true" if clear else "false"})
        try:
            await self._post_json("/collective_rpc", {
                "method": "reload_weights", "kwargs": {"weights_path": weights_path}}, Any)
            await self._post_json("/update_weight_version", {"new_version": str(version)},
                                  Any)
        finally:
            await self._post_empty("/resume")

    async def weight_version(self) -> str | None:
        """The version label the server reports (`GET /weight_info`; dev mode)."""
        data = await self._get_json("/weight_info", Any)
        version = data.get("weight_version") if isinstance(data, dict) else None
        return None if version is None else str(version)

    async def _post_empty(self, path: str, params: Mapping[str, str] | None = None) -> None:
        await self._request("POST", path, params=params)

    async def load(self) -> EngineLoad:
        values = parse_prometheus(await self._get_text("/metrics"), _METRICS)
        if "running" not in values or "waiting" not in values:
            raise EngineProtocolError("/metrics: field 'vllm:num_requests_running' or "
                                      "'vllm:num_requests_waiting' is missing")
        kv = values.get("kv", values.get("kv_old"))
        if kv is None:
            raise EngineProtocolError("/metrics: field 'vllm:kv_cache_usage_perc' is missing")
        return EngineLoad(int(values["running"]), int(values["waiting"]), kv)

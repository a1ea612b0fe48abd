"""vLLM's token-in token-out API: `POST /inference/v1/generate` (vLLM ≥ 0.32, served
with `--enable-scale-out`).

`VLLMEngine(..., tokens_api=True)` sends its calls here instead of to
`/v1/completions`. The request carries the prompt's token ids and vLLM's own
`SamplingParams` fields; the reply carries the output ids, each sampled token's
logprob, and `weight_versions`: which weights sampled which output tokens. That last
field is what lets the client declare the "keep" pause mode: a call frozen across a
weight load continues under the new weights, and its tokens are stamped per version
(`GenerateResult.version_spans`), which `/v1/completions` cannot say.

vLLM labels weights it loaded at start "default" (nothing set them): read as None,
the weights never labelled. Everything else is as `vllm.py` says: the request id in
the body and the `X-Request-Id` header, `priority` with `--scheduling-policy
priority`, `seed`, `structured_outputs`, `cache_salt`; an abort drops the
connection (vLLM aborts the request; its partial output does not reach the client).
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from treadle.engines.base import FinishReason, GenerateRequest, GenerateResult, VersionSpan
from treadle.engines.errors import EngineProtocolError

GENERATE_PATH = "/inference/v1/generate"
# vLLM's label of the weights it started with (`EngineCore._weight_version`).
_UNLABELLED = "default"


class _TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float


class _Logprobs(msgspec.Struct, frozen=True):
    content: list[_TokenLogprob] | None = None


class _Span(msgspec.Struct, frozen=True):
    version: str | None
    start: int
    end: int


class _Choice(msgspec.Struct, frozen=True):
    finish_reason: FinishReason | None
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    weight_versions: list[_Span] | None = None


class _Details(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    prompt_tokens_details: _Details | None = None


class TokensReply(msgspec.Struct, frozen=True):
    """What the client reads of vLLM's `GenerateTokensResponse`."""

    choices: list[_Choice]
    usage: _Usage | None = None


def generate_body(request: GenerateRequest, model: str,
                  structured: dict[str, Any] | None) -> dict[str, Any]:
    """The `/inference/v1/generate` body for one request (`structured`: the
    request's constraint as vLLM's `structured_outputs`, or None)."""
    sampling: dict[str, Any] = {
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "skip_special_tokens": False,
        "detokenize": False,
    }
    if request.logprobs:
        sampling["logprobs"] = 0  # the sampled token's own logprob, no alternatives
    if request.stop_token_ids:
        sampling["stop_token_ids"] = list(request.stop_token_ids)
    if request.seed is not None:
        sampling["seed"] = request.seed
    if structured is not None:
        sampling["structured_outputs"] = structured
    body: dict[str, Any] = {"request_id": request.request_id, "model": model,
                            "token_ids": request.prompt_ids, "sampling_params": sampling}
    if request.priority:
        body["priority"] = request.priority
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body


def parse_tokens_reply(reply: TokensReply, request: GenerateRequest,
                       elapsed_s: float) -> GenerateResult:
    """A decoded `/inference/v1/generate` reply as a result; EngineProtocolError names
    a bad field."""
    what = f"{GENERATE_PATH} reply"
    if len(reply.choices) != 1:
        raise EngineProtocolError(f"{what}: field 'choices': expected 1 choice, "
                                  f"got {len(reply.choices)}")
    choice = reply.choices[0]
    ids = choice.token_ids
    if ids is None:
        raise EngineProtocolError(f"{what}: field 'choices.0.token_ids' is missing")
    if choice.finish_reason is None:
        raise EngineProtocolError(f"{what}: field 'choices.0.finish_reason' is null "
                                  "(the request did not finish)")
    logprobs: list[float] = []
    if request.logprobs:
        content = choice.logprobs.content if choice.logprobs is not None else None
        if content is None or len(content) != len(ids) or any(
                c.token_id != t for c, t in zip(content, ids, strict=True)):
            raise EngineProtocolError(f"{what}: field 'choices.0.logprobs.content' does "
                                      f"not give one logprob for each of the {len(ids)} "
                                      "output tokens")
        logprobs = [c.logprob for c in content]
    spans = tuple(VersionSpan(None if s.version == _UNLABELLED else s.version, s.start, s.end)
                  for s in choice.weight_versions or ())
    if ids and (not spans or spans[0].start != 0 or spans[-1].end != len(ids) or any(
            a.end != b.start for a, b in itertools.pairwise(spans))):
        raise EngineProtocolError(f"{what}: field 'choices.0.weight_versions' does not "
                                  f"cover the {len(ids)} output tokens in order")
    usage = reply.usage
    details = usage.prompt_tokens_details if usage is not None else None
    return GenerateResult(
        request_id=request.request_id, output_ids=ids, logprobs=logprobs,
        finish_reason=choice.finish_reason,
        prompt_tokens=usage.prompt_tokens if usage is not None else len(request.prompt_ids),
        cached_tokens=details.cached_tokens if details is not None else None,
        queued_s=None, generating_s=elapsed_s, version_spans=spans)

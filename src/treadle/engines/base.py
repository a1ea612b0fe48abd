"""The engine interface: one LLM call in token ids, one result out.

Contracts every implementation keeps:

- Token in, token out: `prompt_ids` go to the engine as ids and `output_ids` are the
  engine's sampled ids, never re-tokenized text. `logprobs` (when requested) has one
  entry per output id, the engine's log-probability of that sampled token.
- A request's `constraint` (structured output: a JSON schema, any JSON object) is
  decoded under by an engine whose `capabilities.constraints` has its kind; the
  logprobs are still the engine's, of the tokens sampled under the constraint. An
  engine without that kind raises EngineRequestError, never decodes freely instead.
- `generate` returns a `GenerateResult` for a finished or aborted request, and raises
  only `EngineError` subclasses: `EngineUnavailable` (unreachable, 5xx),
  `EngineTimeout` (past `timeout_s`), `EngineProtocolError` (malformed reply; the
  message names the field), `EngineRequestError` (the engine rejected the request).
- `abort(request_id)` ends an in-flight request: its `generate` returns
  `finish_reason="abort"` with the tokens the engine reported so far (possibly none;
  see each implementation), never raises. Aborting an unknown or finished request is
  a no-op. Cancelling the `generate` task itself also aborts it on the engine, but
  raises `CancelledError` as usual.
- An engine object belongs to the event loop that first used it; `aclose` releases
  its connections (in-flight requests are cancelled).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from treadle.engines.errors import EngineRequestError
from treadle.types import ConstraintKind, OutputConstraint

FinishReason = Literal["stop", "length", "abort"]
# What an engine does with its requests in flight while it loads new weights: aborts
# them, lets them finish first, or freezes them and continues them under the new weights.
PauseMode = Literal["abort", "drain", "keep"]


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from `parts` (SHA-256 of their text), the same in every process."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One LLM call. Validation of ranges is the engine's (a 4xx → EngineRequestError)."""

    request_id: str  # caller-chosen, unique among in-flight requests of one engine; abort key
    prompt_ids: list[int]  # the whole context as token ids (chat template already applied)
    max_tokens: int  # upper bound on generated tokens; hitting it gives finish "length"
    temperature: float = 1.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass
    # Seed of this call's sampling: same seed, prompt and weights, same tokens (up to
    # the engine's batch-dependent float rounding). None: the engine's own randomness.
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end generation ("stop")
    priority: int = 0  # lower is served first by engines scheduling by priority
    logprobs: bool = True  # ask for the sampled tokens' logprobs (RL needs them)
    timeout_s: float | None = None  # wall-clock limit of the whole call; None = no limit
    # Decode the reply under this (structured output); None: sample freely.
    constraint: OutputConstraint | None = None
    # Keys the engine's prefix cache: KV cached under one salt never serves a request
    # with another (vLLM's `cache_salt`). treadle salts with the policy version, so KV
    # computed under old weights is never reused by accident after an update.
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class VersionSpan:
    """Output tokens [start, end) of one call were sampled under the weights the
    engine labels `version` (`Engine.update_weights`'s label; None: never labelled)."""

    version: str | None
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """What the engine produced for one request."""

    request_id: str  # the request's id, echoed
    output_ids: list[int]  # sampled token ids, in order (including a sampled stop token)
    logprobs: list[float]  # one per output id when requested, else empty
    finish_reason: FinishReason  # stop token / EOS, max_tokens, or aborted
    prompt_tokens: int  # prompt length as the engine counted it
    cached_tokens: int | None  # prompt tokens served from the prefix cache; None = not reported
    queued_s: float | None  # time waiting before generation began; None = not reported
    generating_s: float  # time from send to reply (or, if reported, prefill + decode)
    # The weights each output token was sampled under, in order, covering every output
    # id, when the engine reports them (one that can pause with "keep" must: a call
    # frozen across an update holds tokens of two versions). Empty: not reported; all
    # of them came from the weights served when the call was sent.
    version_spans: tuple[VersionSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine can do beyond generating: read by the runtime instead of probing
    the object. An engine declares each capability it has; the defaults are none."""

    # `update_weights` loads new weights in place (vLLM's RL endpoints in dev mode).
    weight_updates: bool = False
    # The kinds of `GenerateRequest.constraint` it decodes under (structured output).
    constraints: frozenset[ConstraintKind] = frozenset()
    # The `PauseMode`s its `update_weights` applies to requests in flight. "keep"
    # also promises `GenerateResult.version_spans` on every result. An engine without
    # "keep" gets none in flight while it loads (the runtime aborts or drains them).
    pause_modes: frozenset[PauseMode] = frozenset()

    def refusal(self, constraint: OutputConstraint | None) -> str | None:
        """Why an engine with these capabilities cannot run a request constrained so,
        or None: it can."""
        if constraint is None or constraint.kind in self.constraints:
            return None
        served = ", ".join(sorted(k.value for k in self.constraints)) or "none"
        return (f"the engine cannot decode under a {constraint.kind.value} constraint "
                f"(structured output it serves: {served})")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's load right now, as its metrics report it."""

    running: int  # requests in the running batch
    waiting: int  # requests queued (or preempted) waiting for a slot
    kv_usage: float  # fraction of KV cache in use, 0.0-1.0


class Engine(ABC):
    """One inference engine instance (one endpoint). See the module docstring."""

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request to its end (or its abort)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """End an in-flight request; its `generate` returns finish "abort". Never raises."""

    @abstractmethod
    async def load(self) -> EngineLoad:
        """Current load; EngineUnavailable / EngineProtocolError when it cannot be read."""

    @abstractmethod
    async def health(self) -> bool:
        """Whether the engine answers its health check now. Never raises."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release connections and cancel in-flight requests. Idempotent."""

    @property
    def capabilities(self) -> EngineCapabilities:
        """What this engine can do (`EngineCapabilities`); none by default."""
        return EngineCapabilities()

    async def update_weights(self, weights_path: str, version: int,
                             mode: PauseMode = "drain", *, recompute_kept: bool = True) -> None:
        """Load new weights from `weights_path` and label them `version`, handling the
        requests in flight by `mode` (one of `capabilities.pause_modes`); only engines
        whose `capabilities.weight_updates` is set implement it. EngineRequestError
        from the others, and for a mode the engine does not declare. With "keep",
        `recompute_kept` says whether the requests frozen across the load compute their
        KV again under the new weights (True) or continue over the KV of the old
        (False: they are all of trajectories that keep their KV across updates)."""
        raise EngineRequestError(f"{type(self).__name__} cannot load weights in place")

    async def context_window(self) -> int | None:
        """The longest context (prompt and reply, in tokens) this engine serves, or
        None: it cannot tell. Never raises."""
        return None

    async def model_problem(self) -> str | None:
        """Why this engine cannot serve the model its client asks for (it serves
        another), or None: it does, or this engine cannot tell. Never raises."""
        return None

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

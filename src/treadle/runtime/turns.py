"""One trajectory's LLM turns, scheduled: the `TurnRunner` the runtime hands out.

`ScheduledTurns.generate` tells the scheduler the turn is ready (on the first turn,
`TrajectoryArrived`; later, the `ToolCallFinished` sent by `tool_finished` did),
waits for the scheduler to admit it to an engine, and sends it there with the
admitted priority. What can happen to the call, and what the runner does:

- it finishes ("stop"/"length"): the reply is returned;
- the scheduler preempts it (`Preempt`): the engine aborts it; the tokens it had
  produced (the emulated engine returns them; vLLM's client cannot, so they are
  lost) are kept, and once admitted again it resumes with them appended to the
  prompt and `max_tokens` reduced by as many — unless the turn is decoded under a
  constraint (`Sampling.constraint`): its grammar cannot resume mid-way, so it
  starts over;
- the engine fails (`EngineUnavailable`, `EngineTimeout`, a malformed reply): the
  runtime checks the engine's health. A dead engine is failed (`EngineFailed`: the
  scheduler re-routes everything it held, this turn included, with a full
  re-prefill elsewhere); a live one gets the turn again (`TurnPreempted`), at most
  `Runtime.turn_retries` times, after which the turn raises `EngineUnavailable`;
- the engine rejects it (`EngineRequestError`, a 4xx): raised at once;
- no engine is live: the runtime fails the waiting turn with `NoEngineAvailable`
  once its grace is over (`Runtime.engine_wait_s`; an engine that joins within it
  picks the turn up).

The returned `TurnOutput` concatenates the tokens of every call of the turn; each
token carries the policy version of the weights that sampled it: the engine's
`version_spans` where it reports them (a call frozen across a "keep" update holds
tokens of two versions), else the version served when the call was sent (no update
finishes while a call of an engine that cannot keep it is in flight). Cancelling
`generate` aborts the call on its engine.

Every call carries a cache salt (`GenerateRequest.cache_salt`): the weights' salt
now (`RunnerHost.cache_salt`) with `KVAcrossUpdates.RECOMPUTE`, so its context is
prefilled again under new weights; with `KEEP`, the salt of the weights of its
first call, so later calls reuse what the engine cached of its context before.

The runner talks to the runtime only through `runtime.contract`: it asks what a
`RunnerHost` offers, and is told what a `Runner` hears (the block "what the runtime
tells it" below).
"""

from __future__ import annotations

import asyncio

from treadle.agent.runner import Sampling, TurnOutput
from treadle.core.events import (
    ToolCallFinished,
    ToolCallStarted,
    TrajectoryArrived,
    TrajectoryEnded,
    TurnFinished,
    TurnPreempted,
)
from treadle.engines.base import FinishReason, GenerateRequest, GenerateResult, derived_seed
from treadle.engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineUnavailable,
)
from treadle.runtime.contract import EngineSlot, RunnerHost
from treadle.types import KVAcrossUpdates

_PRIORITY_BOUND = 2**31 - 1


class ScheduledTurns:
    """The turns of one trajectory on the runtime's engines. Made by `Runtime.turns`;
    a `TurnRunner` for the agent loop and a `contract.Runner` for the runtime."""

    def __init__(self, host: RunnerHost, traj_id: str, group_id: str,
                 kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE, *, judge: bool = False,
                 max_staleness: int | None = None, attempt: int = 0) -> None:
        self.traj_id = traj_id
        # In its calls' request ids after the first attempt: a call of a lost attempt
        # may still run on its engine, which refuses an id in flight.
        self._ids = traj_id if attempt == 0 else f"{traj_id}@{attempt}"
        self.group_id = group_id
        self.kv = kv
        self.judge = judge  # a judge's call: the scheduler's judge class
        self.max_staleness = max_staleness  # its job's bound, told to the scheduler
        self._kept_salt: str | None = None  # with KEEP: the salt of its first call
        self.engine_id: str | None = None  # engine of the last call
        self.preemptions = 0  # calls cut short by the scheduler or a pause
        self.retries = 0  # calls repeated after an engine failure
        self.sampled = 0  # tokens its engines returned, kept or not
        self._rt = host
        self._admission: tuple[str, float] | None = None  # (engine, priority) to run on
        self._admitted = asyncio.Event()  # set when `_admission` or `_failure` is set
        self._failure: EngineError | None = None  # no engine will ever admit it
        self._call: tuple[EngineSlot, str, asyncio.Future[GenerateResult]] | None = None
        self._preempted = False  # the call in flight is being aborted by the scheduler
        self._arrived = False
        self._turn = 0
        self._calls = 0
        self._tool_started = 0.0
        self._waiting_since: float | None = None  # clock time the turn began to wait
        self.done = False  # no more events will be sent

    # -- TurnRunner ------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._rt.policy_version

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       stop_ids: list[int]) -> TurnOutput:
        if self.done:
            raise RuntimeError(f"trajectory {self.traj_id} has ended")
        clock = self._rt.clock
        if not self._arrived:
            self._arrived = True
            self._expect()
            self._rt.tell(TrajectoryArrived(self.traj_id, self.group_id, len(prompt_ids),
                                            judge=self.judge,
                                            max_staleness=self.max_staleness))
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        queued = generating = 0.0
        failures = 0
        finish: FinishReason = "length"
        while len(ids) < max_tokens:
            waited = clock.now()
            await self._wait_admission()
            await self._rt.calls_allowed()  # a weight update in progress holds new calls
            queued += clock.now() - waited
            admission = self._admission
            if admission is None:
                continue  # preempted, or its engine lost, while it waited at the gate
            eid, priority = admission
            self._expect()  # consumed: a later call of this turn waits for a new one
            slot = self._rt.admitted_engine(eid)
            if slot is None:
                continue  # the engine went away since; the scheduler re-routes the turn
            self._calls += 1
            # A resumed call draws new numbers: with the turn's seed again it would
            # replay the draws its first tokens already used.
            seed = sampling.seed
            if seed is not None and ids:
                seed = derived_seed(seed, len(ids))
            request = GenerateRequest(
                request_id=f"{self._ids}:{self._turn}:{self._calls}",
                prompt_ids=prompt_ids + ids, max_tokens=max_tokens - len(ids),
                temperature=sampling.temperature, top_p=sampling.top_p, seed=seed,
                stop_token_ids=stop_ids, priority=_int_priority(priority),
                timeout_s=self._rt.request_timeout_s, constraint=sampling.constraint,
                cache_salt=self._salt())
            sent_version = self._rt.policy_version
            started = clock.now()
            result = await self._send(slot, request)
            generating += clock.now() - started
            if result is None:
                continue  # the runtime dropped the call: its engine is gone
            if isinstance(result, EngineError):
                failures += 1
                if await self._rt.call_failed(slot, result) == "failed":
                    continue  # re-routed by EngineFailed
                if failures > self._rt.turn_retries:
                    raise EngineUnavailable(f"turn {self._turn} of {self.traj_id} failed "
                                            f"{failures} times on {eid}: {result}")
                self.retries += 1
                self._requeue(eid, len(ids))
                continue
            if len(result.logprobs) != len(result.output_ids):
                raise EngineProtocolError(f"{eid} returned {len(result.output_ids)} ids and "
                                          f"{len(result.logprobs)} logprobs")
            self.engine_id = eid
            if result.finish_reason != "abort" or sampling.constraint is None:
                ids += result.output_ids
                logprobs += result.logprobs
                versions += _versions(result, sent_version, eid)
            # (else a constrained reply cut mid-way starts over: its engine's grammar
            # would begin anew after the partial output, and the whole would not parse)
            if result.finish_reason != "abort":
                finish = result.finish_reason
                break
            self.preemptions += 1
            if self._preempted:
                self._preempted = False  # the scheduler queued it again already
            else:
                self._requeue(eid, len(ids))  # a pause (or someone else) aborted it
        self._turn += 1
        return TurnOutput(ids, logprobs, versions, finish, self.engine_id, queued, generating)

    def turn_finished(self, output_tokens: int, context_tokens: int, final: bool) -> None:
        self._rt.tell(TurnFinished(self.traj_id, self.engine_id or "", output_tokens,
                                    context_tokens, final))
        if final:
            self._end()

    def tool_started(self) -> None:
        self._tool_started = self._rt.clock.now()
        self._rt.tell(ToolCallStarted(self.traj_id))

    def tool_finished(self, latency_s: float, output_tokens: int, final: bool) -> None:
        # The scheduler is told the latency on its own clock, whatever the caller measured.
        latency = max(0.0, self._rt.clock.now() - self._tool_started)
        if not final:
            self._expect()
        self._rt.tell(ToolCallFinished(self.traj_id, latency, output_tokens, final))
        if final:
            self._end()

    def ended(self, reason: str) -> None:
        if not self.done:
            if self._arrived:  # the scheduler never heard of one that never asked for a turn
                self._rt.tell(TrajectoryEnded(self.traj_id, reason))
            self._end()

    # -- what the runtime tells it (contract.Runner) -------------------------------------

    def admit(self, engine_id: str, priority: float) -> None:
        self._admission = (engine_id, priority)
        self._failure = None  # an engine came after all
        self._admitted.set()

    def preempt(self, engine_id: str) -> None:
        call = self._call
        self._expect()
        if call is not None and call[0].engine_id == engine_id:
            self._preempted = True
            self._rt.spawn(call[0].engine.abort(call[1]))

    def engine_lost(self, engine_id: str) -> None:
        call = self._call
        if call is not None and call[0].engine_id == engine_id:
            self._expect()
            call[2].cancel()
        elif self._admission is not None and self._admission[0] == engine_id:
            self._expect()

    def abort_for_pause(self) -> None:
        if self._call is not None:
            self._rt.spawn(self._call[0].engine.abort(self._call[1]))

    def fail(self, error: EngineError) -> None:
        self._failure = error
        self._admitted.set()

    @property
    def waiting_since(self) -> float | None:
        if self._admission is not None or self._failure is not None or self.done:
            return None
        return self._waiting_since

    @property
    def admitted_to(self) -> str | None:
        return None if self._admission is None else self._admission[0]

    @property
    def calling_on(self) -> str | None:
        return None if self._call is None else self._call[0].engine_id

    # -- internals --------------------------------------------------------------------

    def _salt(self) -> str:
        if self.kv is KVAcrossUpdates.RECOMPUTE:
            return self._rt.cache_salt
        if self._kept_salt is None:
            self._kept_salt = self._rt.cache_salt
        return self._kept_salt

    def _expect(self) -> None:
        """An admission is due (the scheduler has, or is about to have, the turn queued)."""
        self._admission = None
        self._admitted.clear()

    def _requeue(self, engine_id: str, tokens_so_far: int) -> None:
        self._expect()
        self._rt.tell(TurnPreempted(self.traj_id, engine_id, tokens_so_far))

    async def _wait_admission(self) -> None:
        """Until the scheduler admits the turn; raises what the runtime `fail`s it with
        (it does so once no engine is live and the turn's grace is over)."""
        self._waiting_since = self._rt.clock.now()
        try:
            while self._admission is None:
                if self._failure is not None:
                    raise self._failure
                await self._admitted.wait()
        finally:
            self._waiting_since = None

    async def _send(self, slot: EngineSlot,
                    request: GenerateRequest) -> GenerateResult | EngineError | None:
        """The call's result; its EngineError (not raised); None if the runtime dropped it."""
        call = asyncio.ensure_future(slot.engine.generate(request))
        self._call = (slot, request.request_id, call)
        self._preempted = False
        self._rt.call_started(slot)
        try:
            await asyncio.wait({call})
        except asyncio.CancelledError:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            raise
        finally:
            self._call = None
            # Counted before the host hears the call ended (a runner actor reports the
            # count with that news).
            if call.done() and not call.cancelled() and call.exception() is None:
                self.sampled += len(call.result().output_ids)
            self._rt.call_ended(slot)
        if call.cancelled():
            return None
        error = call.exception()
        if error is None:
            return call.result()
        if isinstance(error, EngineRequestError) or not isinstance(error, EngineError):
            raise error
        return error

    def _end(self) -> None:
        self.done = True
        self._rt.trajectory_done(self)


def _versions(result: GenerateResult, sent_version: int, engine_id: str) -> list[int]:
    """The policy version of each output token of `result` (see the module docstring);
    an engine's label is the version `Engine.update_weights` gave it, or None for
    weights never labelled (those it served when the call was sent)."""
    if not result.version_spans:
        return [sent_version] * len(result.output_ids)
    versions: list[int] = []
    for span in result.version_spans:
        try:
            version = sent_version if span.version is None else int(span.version)
        except ValueError:
            raise EngineProtocolError(f"{engine_id} labels its weights {span.version!r}, "
                                      "not a policy version") from None
        versions += [version] * (span.end - span.start)
    return versions


def _int_priority(priority: float) -> int:
    """Engines take integer priorities (lower first); the scheduler's are floats."""
    return max(-_PRIORITY_BOUND, min(_PRIORITY_BOUND, round(priority)))

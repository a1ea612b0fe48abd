"""A trajectory's turn journal, and resuming from it after a restart.

    run_agent(..., journal=writer)                      # each completed turn, kept
    resume = plan_resume(turns, resumes, attempt=2, replay_of=episode.replay_of)
    run_agent(..., resume=resume)                       # the next attempt, after it

A *completed turn* is a reply and the tool calls it asked for, their results shown
to the model. The journal keeps of each what the loop needs to build the same
context and record again without an engine or a tool: the runner's `TurnOutput`
(ids, logprobs, policy versions, engine, seconds) and each call the episode ran
(name, arguments, its result as the model saw it); for a replayed workload
trajectory (`runtime.replay`), the turn's tool gap record. Bodies are MessagePack
(msgspec: a 400-token turn encodes in ~6 µs, where JSON took ~390 µs, its
logprobs' text the most of it), written by `JournaledTurn.encode`, read back by
`JournaledTurn.decode`; where they are kept is the caller's (the service:
`treadle.store.journal`).

Resuming (`plan_resume`) keeps the journal's longest prefix of turns whose every
call's tool can be brought back (`ToolReplay.NONE`: its result is enough; `RERUN`:
run again in the fresh episode, in order, to rebuild what it left); a turn with an
`OPAQUE` call and every turn after it run again. The loop then runs unchanged over
the kept turns: `ReplayingRunner` answers their replies without an engine and keeps
their events from the runner (the scheduler first hears of the trajectory at its
first live turn, the whole context its prompt), `Episode.replay` answers their
calls. So the resumed record and token context, up to the crash, are the ones the
first attempt built: the same ids, logprobs, versions, segments and turns; only the
replayed tool gaps' seconds are the resume's.

What a crash costs: the turn in flight (its reply, or its tools) is not in the
journal and runs again — a tool call running at the crash is never run twice in the
same sandbox, for the resumed attempt gets a fresh one rebuilt from the kept calls.
Limits: a trajectory's deadline counts again from the resume; sampling seeds are
per turn index, so a seeded turn samples as it would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from treadle.agent.runner import Sampling, TurnOutput, TurnRunner
from treadle.envs.tools.base import ToolRecord, ToolReplay, ToolResult
from treadle.types import ResumePoint, ToolCall

encode = msgspec.msgpack.encode  # a journal body, from JSON-like values
decode = msgspec.msgpack.decode
# What decoding a body that is not one of ours raises (or reading its fields).
BAD_BODY = (msgspec.DecodeError, ValueError, KeyError, TypeError)

# Resuming from the prompt although the journal has turns: the service's setting
# (`resume_from="prompt"`), to measure what turn-level resume saves.
FROM_PROMPT = "resume_from is prompt"


@dataclass(frozen=True, slots=True)
class JournaledTurn:
    """One completed turn, as the journal keeps it (module docstring)."""

    index: int  # its index in the trajectory, from 0
    output: TurnOutput  # the reply, as the runner returned it
    calls: tuple[ToolRecord, ...] = ()  # the tool calls the episode ran for it, in order
    tool_call: ToolCall | None = None  # a replayed workload turn's tool gap record

    @property
    def tokens(self) -> int:
        """Tokens the reply sampled."""
        return len(self.output.output_ids)

    def encode(self) -> bytes:
        return encode({
            "index": self.index,
            "output": dump_output(self.output),
            "calls": [{"name": c.name, "arguments": c.arguments, "output": c.result.output,
                       "error": c.result.error, "latency_s": c.result.latency_s,
                       "final_answer": c.result.final_answer, "done": c.result.done}
                      for c in self.calls],
            "tool_call": None if (t := self.tool_call) is None else {
                "name": t.name, "arguments": t.arguments, "latency_s": t.latency_s,
                "output_tokens": t.output_tokens, "error": t.error},
        })

    @classmethod
    def decode(cls, body: bytes) -> JournaledTurn:
        """One of `BAD_BODY` for a body `encode` did not write."""
        d = decode(body)
        output = load_output(d["output"])
        calls = tuple(ToolRecord(f"call_{i}", c["name"], dict(c["arguments"]), ToolResult(
            c["output"], c["error"], float(c["latency_s"]), c["final_answer"], bool(c["done"])))
            for i, c in enumerate(d["calls"]))
        t = d["tool_call"]
        tool_call = None if t is None else ToolCall(t["name"], dict(t["arguments"]),
                                                    float(t["latency_s"]),
                                                    int(t["output_tokens"]), t["error"])
        return cls(int(d["index"]), output, calls, tool_call)


def dump_output(o: TurnOutput) -> dict[str, Any]:
    """A runner's reply as journal bodies hold it (JSON-able)."""
    return {"ids": o.output_ids, "logprobs": o.logprobs, "versions": o.policy_versions,
            "finish_reason": o.finish_reason, "engine_id": o.engine_id,
            "queued_s": o.queued_s, "generating_s": o.generating_s}


def load_output(o: dict[str, Any]) -> TurnOutput:
    """`dump_output`'s reply back (KeyError, ValueError, TypeError if it is not one)."""
    return TurnOutput(list(o["ids"]), [float(x) for x in o["logprobs"]], list(o["versions"]),
                      o["finish_reason"], o["engine_id"], float(o["queued_s"]),
                      float(o["generating_s"]))


class TurnJournal(Protocol):
    """Where a running trajectory's completed turns go (the service's writer batches
    them into its store, off the trajectory's path)."""

    def sampled(self, tokens: int) -> None:
        """A live reply of `tokens` tokens is in; its turn is not complete yet (what a
        crash now would throw away: the service counts it)."""
        ...

    def turn(self, entry: JournaledTurn) -> None:
        """Keep a completed turn; returns at once."""
        ...


ReplayOf = Callable[[str], ToolReplay]  # how a tool's recorded calls come back, by name


@dataclass(frozen=True, slots=True)
class Resume:
    """What an attempt resumes with: the turns it keeps, and its record's `resumed`
    (earlier resumes, then this one)."""

    turns: tuple[JournaledTurn, ...]
    resumed: tuple[ResumePoint, ...]
    calls: tuple[ToolRecord, ...] = field(init=False)  # the kept turns' calls, in order

    def __post_init__(self) -> None:
        object.__setattr__(self, "calls", tuple(c for t in self.turns for c in t.calls))

    @property
    def point(self) -> ResumePoint:
        """This attempt's resume."""
        return self.resumed[-1]


# How an attempt resumes, given its episode's tools (None: it has none): what the
# service hands a restarted attempt's runner (`service.journal.JournalWriter.resume`).
ResumePlan = Callable[[ReplayOf | None], Resume]


def plan_resume(turns: Sequence[bytes], resumes: Sequence[bytes], *, attempt: int,
                replay_of: ReplayOf | None,
                from_prompt: bool = False) -> Resume:
    """The resume of attempt `attempt` from a journal's turn bodies (turn 0 first)
    and earlier resumes' bodies (`resume_body`). `replay_of` says how a tool's calls
    come back (None: the trajectory calls no tools, e.g. a replayed workload);
    `from_prompt` keeps no turn. A body that does not read ends the kept prefix."""
    kept: list[JournaledTurn] = []
    reason = FROM_PROMPT if from_prompt else ""
    tokens = 0
    for i, body in enumerate(turns):
        try:
            entry = JournaledTurn.decode(body)
        except BAD_BODY as e:
            reason = reason or f"turn {i}: its journal entry does not read ({e})"
        else:
            tokens += entry.tokens
            if not reason and entry.index != i:
                reason = f"turn {i}: the journal has turn {entry.index} there"
            opaque = [c.name for c in entry.calls
                      if replay_of is not None and replay_of(c.name) is ToolReplay.OPAQUE]
            if not reason and opaque:
                reason = f"turn {i}: tool {opaque[0]!r} cannot be replayed"
            if not reason:
                kept.append(entry)
    rerun = sum(1 for t in kept for c in t.calls
                if replay_of is not None and replay_of(c.name) is ToolReplay.RERUN)
    point = ResumePoint(attempt, len(kept), rerun, len(turns) - len(kept),
                        tokens - sum(t.tokens for t in kept), reason)
    return Resume(tuple(kept), (*load_points(resumes), point))


@dataclass(frozen=True, slots=True)
class ResumeFrom:
    """What a restarted attempt resumes from, before its episode is up: its
    trajectory's journal as kept (turn bodies, earlier resumes' bodies). It travels
    to where the attempt runs (a runner actor), which plans the resume there with
    its episode's tools (`plan`)."""

    attempt: int
    turns: tuple[bytes, ...]
    resumes: tuple[bytes, ...]
    from_prompt: bool = False  # keep no turn (`plan_resume`)

    def plan(self, replay_of: ReplayOf | None) -> Resume:
        return plan_resume(self.turns, self.resumes, attempt=self.attempt,
                           replay_of=replay_of, from_prompt=self.from_prompt)

    def planner(self, recorded: Callable[[ResumePoint], None]) -> ResumePlan:
        """`plan` as the attempt's runner calls it, each resume planned handed to
        `recorded` (for the journal) before it is returned."""
        def planned(replay_of: ReplayOf | None) -> Resume:
            resume = self.plan(replay_of)
            recorded(resume.point)
            return resume
        return planned


def resume_body(point: ResumePoint) -> bytes:
    """A resume as the journal keeps it (read back by `plan_resume`)."""
    return encode({"attempt": point.attempt, "turn": point.turn,
                   "rerun_calls": point.rerun_calls, "discarded_turns": point.discarded_turns,
                   "discarded_tokens": point.discarded_tokens, "reason": point.reason})


def load_points(bodies: Sequence[bytes]) -> tuple[ResumePoint, ...]:
    """Resumes as `resume_body` wrote them, back."""
    out = []
    for body in bodies:
        d: dict[str, Any] = decode(body)
        out.append(ResumePoint(int(d["attempt"]), int(d["turn"]), int(d["rerun_calls"]),
                               int(d["discarded_turns"]), int(d["discarded_tokens"]),
                               str(d["reason"])))
    return tuple(out)


class ReplayingRunner:
    """A `TurnRunner` that answers the first turns from a journal, then is `inner`.

    A replayed turn's events (its end, its tool gap) are the journal's, not news: the
    inner runner hears none of them, and hears the trajectory first at its first
    live `generate`. `ended` always reaches it."""

    def __init__(self, inner: TurnRunner, outputs: Sequence[TurnOutput]) -> None:
        self.inner = inner
        self._outputs = list(reversed(outputs))
        self._replaying = False  # the last reply came from the journal

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       stop_ids: list[int]) -> TurnOutput:
        self._replaying = bool(self._outputs)
        if self._replaying:
            return self._outputs.pop()
        return await self.inner.generate(prompt_ids, max_tokens, sampling, stop_ids)

    def turn_finished(self, output_tokens: int, context_tokens: int, final: bool) -> None:
        if not self._replaying:
            self.inner.turn_finished(output_tokens, context_tokens, final)

    def tool_started(self) -> None:
        if not self._replaying:
            self.inner.tool_started()

    def tool_finished(self, latency_s: float, output_tokens: int, final: bool) -> None:
        if not self._replaying:
            self.inner.tool_finished(latency_s, output_tokens, final)

    def ended(self, reason: str) -> None:
        self.inner.ended(reason)


__all__ = [
    "BAD_BODY",
    "FROM_PROMPT",
    "JournaledTurn",
    "ReplayOf",
    "ReplayingRunner",
    "Resume",
    "ResumePlan",
    "TurnJournal",
    "decode",
    "dump_output",
    "encode",
    "load_output",
    "load_points",
    "plan_resume",
    "resume_body",
]

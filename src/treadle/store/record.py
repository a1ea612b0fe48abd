"""The trajectory record: the one wire shape of a trajectory, as JSON.

`trajectory_to_record` turns a `Trajectory` into a JSON-able dict and
`trajectory_from_record` turns it back; the round trip is exact (floats keep every
bit, enums come back as enums). The store keeps finished trajectories in this shape,
the JSONL export writes it one per line, and the service streams it as NDJSON.

Reading is strict: every field below is required, unknown fields are refused, types
are checked (an int where a number is expected is accepted and becomes a float; a
bool is never a number), numbers must be finite (JSON has no NaN), and a bad record
raises `RecordError` naming the field, e.g. ``segments[1].logprobs[7]``. Writing
checks the same invariants, so what is written can always be read back.

Record, version 1 (JSON types; ``?`` = may be null)::

    version          int      1; a reader refuses versions it does not know
    trajectory_id    string   unique id; the prefix-cache routing key (non-empty)
    group_id         string   GRPO group: siblings of one task share it (non-empty)
    repetition       int      0..n-1 within the group
    task_id          string   the task it samples ("" when unknown)
    status           string   pending | running | completed | truncated | max_turns
                              | timeout | aborted | error (`TrajectoryStatus`)
    reason           string?  why it ended, for any status but completed
    failure_stage    string?  init | engine | tool | eval | runtime; set exactly
                              when status is "error" (`FailureStage`)
    infra_failure    bool     status == "error": a trainer drops it, it is no reward 0
    reward           number?  null until scored; always null for status "error"
    metrics          object   reward parts, name -> number (e.g. exact_match)
    attempt          int      retries after an infrastructure failure (0 = first run)
    prompt_tokens    int      length of the initial context
    output_tokens    int      sum of the turns' output_tokens (a check on the turns)
    turns            array    one object per LLM turn, in order:
        index            int      0-based position
        output_tokens    int      tokens the model sampled in this turn
        engine_id        string?  engine that generated it (the last one if moved)
        queued_s         number   waiting before the first token
        generating_s     number   first token (prefill included) to last token
        policy_version   int      weights version that sampled this turn
        tool_call        object?  the tool call this turn asked for:
            name             string   tool name as the model wrote it
            arguments        object   parsed JSON arguments
            latency_s        number   seconds from start to result
            output_tokens    int      tokens of the observation added to the context
            error            string?  tool-side error shown to the model
    segments         array    token-exact training sequences (one unless the
                              context was edited), each:
        prompt_ids       [int]    the context before the segment's first turn
        response_ids     [int]    model and observation tokens
        loss_mask        [int]    1 = sampled by the model, 0 = observation
        logprobs         [number] the engine's logprob per token, 0.0 where mask is 0
        policy_versions  [int]    weights version per response token
                                  (the last four have the length of response_ids)
    timings          object   where the wall time went, seconds:
        llm_s            number   generating, prefill included
        tool_s           number   inside tool calls
        queue_s          number   waiting for an engine
        started_at       number?  clock time of the first event
        finished_at      number?  clock time of the terminal status

Integers are non-negative everywhere. `dumps_record` is the serialisation the store
and the exports use: compact separators, UTF-8 kept as is, keys in the order above.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from treadle.store.errors import RecordError
from treadle.types import (
    FailureStage,
    GroupKey,
    Timings,
    TokenSegment,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

RECORD_VERSION = 1

_E = TypeVar("_E", bound=enum.Enum)

_TOP_KEYS = frozenset({
    "version", "trajectory_id", "group_id", "repetition", "task_id", "status", "reason",
    "failure_stage", "infra_failure", "reward", "metrics", "attempt", "prompt_tokens",
    "output_tokens", "turns", "segments", "timings"})
_TURN_KEYS = frozenset({"index", "output_tokens", "engine_id", "queued_s", "generating_s",
                        "policy_version", "tool_call"})
_TOOL_KEYS = frozenset({"name", "arguments", "latency_s", "output_tokens", "error"})
# In the dataclasses' order (the export's columns follow it).
SEGMENT_FIELDS = tuple(f.name for f in dataclasses.fields(TokenSegment))
TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(Timings))
_SEGMENT_KEYS = frozenset(SEGMENT_FIELDS)
_TIMING_KEYS = frozenset(TIMING_FIELDS)


def trajectory_to_record(t: Trajectory) -> dict[str, Any]:
    """The record of `t` (fresh lists: mutating one does not touch the other).

    Raises RecordError if `t` breaks an invariant the reader checks: a failure stage
    without status ERROR (or the reverse), a reward on an ERROR, a malformed segment.
    """
    _check_invariants(t)
    for i, seg in enumerate(t.segments):
        try:
            seg.validate()
        except ValueError as e:
            raise RecordError(f"segments[{i}]: {e}") from None
    return {
        "version": RECORD_VERSION,
        "trajectory_id": t.trajectory_id,
        "group_id": t.key.group_id,
        "repetition": t.key.repetition,
        "task_id": t.task_id,
        "status": t.status.value,
        "reason": t.reason,
        "failure_stage": None if t.failure_stage is None else t.failure_stage.value,
        "infra_failure": t.infra_failure,
        "reward": t.reward,
        "metrics": dict(t.metrics),
        "attempt": t.attempt,
        "prompt_tokens": t.prompt_tokens,
        "output_tokens": t.output_tokens,
        "turns": [_turn_to_record(turn) for turn in t.turns],
        "segments": [{
            "prompt_ids": list(s.prompt_ids),
            "response_ids": list(s.response_ids),
            "loss_mask": list(s.loss_mask),
            "logprobs": list(s.logprobs),
            "policy_versions": list(s.policy_versions),
        } for s in t.segments],
        "timings": {
            "llm_s": t.timings.llm_s,
            "tool_s": t.timings.tool_s,
            "queue_s": t.timings.queue_s,
            "started_at": t.timings.started_at,
            "finished_at": t.timings.finished_at,
        },
    }


def trajectory_from_record(record: Mapping[str, Any]) -> Trajectory:
    """The `Trajectory` a record describes; RecordError names the first bad field."""
    r = _Fields(record, "", _TOP_KEYS)
    version = r.integer("version")
    if version != RECORD_VERSION:
        raise RecordError(f"version: {version} is not a record version this treadle reads "
                          f"(it reads {RECORD_VERSION})")
    turns = [_turn_from_record(item, f"turns[{i}]")
             for i, item in enumerate(r.array("turns"))]
    segments = [_segment_from_record(item, f"segments[{i}]")
                for i, item in enumerate(r.array("segments"))]
    tm = _Fields(r.value("timings"), "timings", _TIMING_KEYS)
    t = Trajectory(
        trajectory_id=r.text("trajectory_id", non_empty=True),
        key=GroupKey(r.text("group_id", non_empty=True), r.integer("repetition")),
        prompt_tokens=r.integer("prompt_tokens"),
        turns=turns,
        segments=segments,
        status=r.choice("status", TrajectoryStatus),
        reason=r.opt_text("reason"),
        failure_stage=r.opt_choice("failure_stage", FailureStage),
        reward=r.opt_number("reward"),
        metrics=_metrics(r.value("metrics")),
        attempt=r.integer("attempt"),
        timings=Timings(
            llm_s=tm.number("llm_s"), tool_s=tm.number("tool_s"),
            queue_s=tm.number("queue_s"), started_at=tm.opt_number("started_at"),
            finished_at=tm.opt_number("finished_at")),
        task_id=r.text("task_id"),
    )
    _check_invariants(t)
    if r.boolean("infra_failure") != t.infra_failure:
        raise RecordError(f"infra_failure: must be {t.infra_failure} for status "
                          f"{t.status.value!r}")
    if r.integer("output_tokens") != t.output_tokens:
        raise RecordError(f"output_tokens: {record['output_tokens']} is not the sum of the "
                          f"turns' output_tokens ({t.output_tokens})")
    return t


def dumps_record(record: Mapping[str, Any]) -> str:
    """One line of JSON (no newline); RecordError if a number is NaN or infinite."""
    try:
        return json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError as e:
        raise RecordError(f"record cannot be JSON: {e}") from None


def loads_record(text: str) -> Trajectory:
    """`trajectory_from_record` of one line of JSON; RecordError if it is not JSON."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"record is not JSON: {e.msg} at character {e.pos}") from None
    return trajectory_from_record(value)


def _check_invariants(t: Trajectory) -> None:
    error = t.status is TrajectoryStatus.ERROR
    if error != (t.failure_stage is not None):
        raise RecordError(f"failure_stage: must be set exactly when status is 'error' "
                          f"(status {t.status.value!r}, failure_stage "
                          f"{None if t.failure_stage is None else t.failure_stage.value!r})")
    if error and t.reward is not None:
        raise RecordError(f"reward: must be null for status 'error' (an infrastructure "
                          f"failure has no reward), got {t.reward!r}")


def _turn_to_record(turn: Turn) -> dict[str, Any]:
    call = turn.tool_call
    return {
        "index": turn.index,
        "output_tokens": turn.output_tokens,
        "engine_id": turn.engine_id,
        "queued_s": turn.queued_s,
        "generating_s": turn.generating_s,
        "policy_version": turn.policy_version,
        "tool_call": None if call is None else {
            "name": call.name,
            "arguments": dict(call.arguments),
            "latency_s": call.latency_s,
            "output_tokens": call.output_tokens,
            "error": call.error,
        },
    }


def _turn_from_record(value: Any, path: str) -> Turn:
    r = _Fields(value, path, _TURN_KEYS)
    call_value = r.value("tool_call")
    call = None
    if call_value is not None:
        c = _Fields(call_value, f"{path}.tool_call", _TOOL_KEYS)
        arguments = c.value("arguments")
        if not isinstance(arguments, dict):
            raise RecordError(f"{path}.tool_call.arguments: must be a JSON object")
        call = ToolCall(name=c.text("name"), arguments=dict(arguments),
                        latency_s=c.number("latency_s"),
                        output_tokens=c.integer("output_tokens"), error=c.opt_text("error"))
    return Turn(index=r.integer("index"), output_tokens=r.integer("output_tokens"),
                engine_id=r.opt_text("engine_id"), tool_call=call,
                queued_s=r.number("queued_s"), generating_s=r.number("generating_s"),
                policy_version=r.integer("policy_version"))


def _segment_from_record(value: Any, path: str) -> TokenSegment:
    r = _Fields(value, path, _SEGMENT_KEYS)
    seg = TokenSegment(
        prompt_ids=_int_list(r.value("prompt_ids"), f"{path}.prompt_ids"),
        response_ids=_int_list(r.value("response_ids"), f"{path}.response_ids"),
        loss_mask=_int_list(r.value("loss_mask"), f"{path}.loss_mask"),
        logprobs=_float_list(r.value("logprobs"), f"{path}.logprobs"),
        policy_versions=_int_list(r.value("policy_versions"), f"{path}.policy_versions"))
    try:
        seg.validate()
    except ValueError as e:
        raise RecordError(f"{path}: {e}") from None
    return seg


def _metrics(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise RecordError("metrics: must be a JSON object of numbers")
    return {str(k): _as_number(v, f"metrics.{k}") for k, v in value.items()}


def _int_list(value: Any, path: str) -> list[int]:
    if not isinstance(value, list):
        raise RecordError(f"{path}: must be an array of integers")
    for i, x in enumerate(value):
        if type(x) is not int or x < 0:
            raise RecordError(f"{path}[{i}]: must be a non-negative integer, got {x!r:.80}")
    return list(value)


def _float_list(value: Any, path: str) -> list[float]:
    if not isinstance(value, list):
        raise RecordError(f"{path}: must be an array of numbers")
    out = list(value)
    for i, x in enumerate(out):
        if type(x) is not float:
            out[i] = _as_number(x, f"{path}[{i}]")
        elif not math.isfinite(x):
            raise RecordError(f"{path}[{i}]: must be finite, got {x!r}")
    return out


def _as_number(x: Any, path: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise RecordError(f"{path}: must be a number, got {x!r:.80}")
    if not math.isfinite(x):
        raise RecordError(f"{path}: must be finite, got {x!r}")
    return float(x)


class _Fields:
    """Typed access to one JSON object's fields; errors carry the object's path."""

    def __init__(self, value: Any, path: str, keys: frozenset[str]) -> None:
        where = path or "record"
        if not isinstance(value, Mapping):
            raise RecordError(f"{where}: must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - keys)
        if unknown:
            raise RecordError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
        missing = sorted(keys - set(value))
        if missing:
            raise RecordError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
        self._value = value
        self._prefix = f"{path}." if path else ""

    def value(self, key: str) -> Any:
        return self._value[key]

    def _name(self, key: str) -> str:
        return self._prefix + key

    def text(self, key: str, *, non_empty: bool = False) -> str:
        v = self._value[key]
        if not isinstance(v, str) or (non_empty and not v):
            kind = "a non-empty string" if non_empty else "a string"
            raise RecordError(f"{self._name(key)}: must be {kind}, got {v!r:.80}")
        return v

    def opt_text(self, key: str) -> str | None:
        return None if self._value[key] is None else self.text(key)

    def integer(self, key: str) -> int:
        v = self._value[key]
        if type(v) is not int or v < 0:
            raise RecordError(f"{self._name(key)}: must be a non-negative integer, "
                              f"got {v!r:.80}")
        return v

    def boolean(self, key: str) -> bool:
        v = self._value[key]
        if not isinstance(v, bool):
            raise RecordError(f"{self._name(key)}: must be true or false, got {v!r:.80}")
        return v

    def number(self, key: str) -> float:
        return _as_number(self._value[key], self._name(key))

    def opt_number(self, key: str) -> float | None:
        return None if self._value[key] is None else self.number(key)

    def array(self, key: str) -> list[Any]:
        v = self._value[key]
        if not isinstance(v, list):
            raise RecordError(f"{self._name(key)}: must be an array")
        return v

    def choice(self, key: str, cls: type[_E]) -> _E:
        v = self._value[key]
        try:
            return cls(v)
        except ValueError:
            allowed = " | ".join(str(m.value) for m in cls)
            raise RecordError(f"{self._name(key)}: must be one of {allowed}, "
                              f"got {v!r:.80}") from None

    def opt_choice(self, key: str, cls: type[_E]) -> _E | None:
        return None if self._value[key] is None else self.choice(key, cls)

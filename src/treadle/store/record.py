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

Writing always gives version 5. Older records are still read: version 1 (a store
or an export written before sub-agents) lacks the fields marked (v2) to (v5),
version 2 (before reward sources) those marked (v3) to (v5), version 3 (before
asynchronous RL) those marked (v4) and (v5), version 4 (before rubrics) those
marked (v5); they read as their defaults (no parent, no children, trainable, empty
metadata, each segment starting at turn 0 with reason "start"; no reward source;
KV recomputed across updates; no reward vector). A record must have exactly the
fields of its version.

Record, version 5 (JSON types; ``?`` = may be null)::

    version          int      5 (or 4, 3, 2, 1); a reader refuses versions it does not know
    trajectory_id    string   unique id; the prefix-cache routing key (non-empty)
    group_id         string   GRPO group: siblings of one task share it (non-empty)
    repetition       int      0..n-1 within the group
    task_id          string   the task it samples ("" when unknown)
    status           string   pending | running | completed | truncated | max_turns
                              | timeout | aborted | error (`TrajectoryStatus`)
    reason           string?  why it ended, for any status but completed
    failure_stage    string?  init | engine | tool | eval | harness | runtime; set
                              exactly when status is "error" (`FailureStage`)
    infra_failure    bool     status == "error": a trainer drops it, it is no reward 0
    reward           number?  null until scored; always null for status "error"
    reward_source    string?  (v3) what scored it: verifier | exit_code | reward_file
                              | owner | rubric (v5) (`RewardSource`); set only with a
                              reward, null when unscored or not said
    rewards          object   (v5) a rubric's reward vector, and
    judgements       array    (v5) its judges' verdicts (`store.rewards` has both)
    metrics          object   reward parts, name -> number (e.g. exact_match)
    attempt          int      retries after an infrastructure failure (0 = first run)
    prompt_tokens    int      length of the initial context
    output_tokens    int      sum of the turns' output_tokens (a check on the turns)
    parent_id        string?  (v2) the trajectory this one is a sub-agent of (non-empty,
                              not its own id); null for a top-level trajectory
    children         [string] (v2) the sub-agent trajectories it started, in creation
                              order (unique, non-empty, not its own id)
    trainable        bool     (v2) false for a frozen sub-agent: every loss_mask is 0
                              and the converters never train on it
    metadata         object   (v2) the caller's, any JSON values (numbers finite)
    policy_span      [int]?   (v4) [oldest, newest] policy version that sampled its
                              tokens (mask-1 segment tokens and the turns' versions;
                              `Trajectory.policy_span`, a check on them); null when
                              the model sampled nothing. Two values apart: it ran
                              across a weight update (each token says which version)
    kv_across_updates string  (v4) recompute | keep (`KVAcrossUpdates`): what its
                              calls after a weight update did with the KV of its
                              context cached under the old weights
    resumed          array    (v6) the restarts it survived, oldest first
                              (`ResumePoint`): attempt, turn (completed turns kept;
                              0: from the prompt), rerun_calls (recorded tool calls
                              run again to rebuild its sandbox), discarded_turns and
                              discarded_tokens (journaled but not kept), reason
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
        constraint       object   (v4; also written by version 3 writers, which
                                  did not bump for it) only where the reply was
                                  decoded under one (structured output; absent:
                                  sampled freely):
            kind             string   json_schema | json_object (`ConstraintKind`)
            name             string?  json_schema only: the caller's name for it
            schema           object   json_schema only: the JSON schema
    segments         array    token-exact training sequences (one unless the
                              context was edited), each:
        prompt_ids       [int]    the context before the segment's first turn
        response_ids     [int]    model and observation tokens
        loss_mask        [int]    1 = sampled by the model, 0 = observation
        logprobs         [number] the engine's logprob per token, 0.0 where mask is 0
        policy_versions  [int]    weights version per response token
                                  (the last four have the length of response_ids)
        start_turn       int      (v2) the turn whose context the segment begins
        start_reason     string   (v2) why it began (non-empty): "start" for the
                                  first, else why the context could not be extended
                                  (`TokenSegment.start_reason`)
    timings          object   where the wall time went, seconds:
        llm_s            number   generating, prefill included
        tool_s           number   inside tool calls
        queue_s          number   waiting for an engine
        started_at       number?  clock time of the first event
        finished_at      number?  clock time of the terminal status

A turn's ``constraint`` is written only where there is one, so a record of freely
sampled turns is what it was before the field existed (and an older reader still
reads it).

Integers are non-negative everywhere (metadata aside: it is the caller's). `dumps_record`
is the serialisation the store and the exports use: compact separators, UTF-8 kept as
is, keys in the order above.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from treadle.store.errors import RecordError
from treadle.store.fields import (
    Fields,
    as_number,
    float_list,
    int_list,
    json_value,
    text_list,
)
from treadle.store.rewards import rewards_from_record, rewards_to_record
from treadle.types import (
    ConstraintKind,
    FailureStage,
    GroupKey,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    KVAcrossUpdates,
    OutputConstraint,
    ResumePoint,
    RewardSource,
    Timings,
    TokenSegment,
    ToolCall,
    Trajectory,
    TrajectoryStatus,
    Turn,
)

RECORD_VERSION = 6  # what the writer writes
READ_VERSIONS = (1, 2, 3, 4, 5, 6)  # what the reader reads

_TOP_KEYS_V1 = frozenset({
    "version", "trajectory_id", "group_id", "repetition", "task_id", "status", "reason",
    "failure_stage", "infra_failure", "reward", "metrics", "attempt", "prompt_tokens",
    "output_tokens", "turns", "segments", "timings"})
_TOP_KEYS_V2 = _TOP_KEYS_V1 | {"parent_id", "children", "trainable", "metadata"}
_TOP_KEYS_V3 = _TOP_KEYS_V2 | {"reward_source"}
_TOP_KEYS_V4 = _TOP_KEYS_V3 | {"policy_span", "kv_across_updates"}
_TOP_KEYS_V5 = _TOP_KEYS_V4 | {"rewards", "judgements"}
_TOP_KEYS = _TOP_KEYS_V5 | {"resumed"}
_RESUME_KEYS = frozenset({"attempt", "turn", "rerun_calls", "discarded_turns",
                          "discarded_tokens", "reason"})
_TURN_KEYS = frozenset({"index", "output_tokens", "engine_id", "queued_s", "generating_s",
                        "policy_version", "tool_call"})
_TOOL_KEYS = frozenset({"name", "arguments", "latency_s", "output_tokens", "error"})
_CONSTRAINT_KEYS = {ConstraintKind.JSON_SCHEMA: frozenset({"kind", "name", "schema"}),
                    ConstraintKind.JSON_OBJECT: frozenset({"kind"})}
# The token lists only, in the dataclass's order: the export makes a list column of
# each, so the scalar segment fields (SEGMENT_META) must not be among them.
SEGMENT_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "policy_versions")
SEGMENT_META = ("start_turn", "start_reason")  # (v2)
TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(Timings))
_SEGMENT_KEYS_V1 = frozenset(SEGMENT_FIELDS)
_SEGMENT_KEYS = _SEGMENT_KEYS_V1 | frozenset(SEGMENT_META)
_TIMING_KEYS = frozenset(TIMING_FIELDS)


def trajectory_to_record(t: Trajectory) -> dict[str, Any]:
    """The record of `t` (fresh lists: mutating one does not touch the other).

    Raises RecordError if `t` breaks an invariant the reader checks: a failure stage
    without status ERROR (or the reverse), a reward on an ERROR, a malformed segment,
    a frozen trajectory with a trained token, bad sub-agent links or metadata that
    is not JSON.
    """
    _check_invariants(t)
    for i, seg in enumerate(t.segments):
        path = f"segments[{i}]"
        try:
            seg.validate()
        except ValueError as e:
            raise RecordError(f"{path}: {e}") from None
        if type(seg.start_turn) is not int or seg.start_turn < 0:
            raise RecordError(f"{path}.start_turn: must be a non-negative integer, "
                              f"got {seg.start_turn!r:.80}")
        if not isinstance(seg.start_reason, str) or not seg.start_reason:
            raise RecordError(f"{path}.start_reason: must be a non-empty string, "
                              f"got {seg.start_reason!r:.80}")
    _check_links(t)
    if not isinstance(t.trainable, bool):
        raise RecordError(f"trainable: must be true or false, got {t.trainable!r:.80}")
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
        "reward_source": None if t.reward_source is None else t.reward_source.value,
        **rewards_to_record(t),
        "metrics": dict(t.metrics),
        "attempt": t.attempt,
        "prompt_tokens": t.prompt_tokens,
        "output_tokens": t.output_tokens,
        "parent_id": t.parent_id,
        "children": list(t.children),
        "trainable": t.trainable,
        "metadata": _metadata(t.metadata),
        "policy_span": None if (span := t.policy_span) is None else list(span),
        "kv_across_updates": t.kv_across_updates.value,
        "resumed": [dataclasses.asdict(p) for p in t.resumed],
        "turns": [_turn_to_record(turn) for turn in t.turns],
        "segments": [{
            "prompt_ids": list(s.prompt_ids),
            "response_ids": list(s.response_ids),
            "loss_mask": list(s.loss_mask),
            "logprobs": list(s.logprobs),
            "policy_versions": list(s.policy_versions),
            "start_turn": s.start_turn,
            "start_reason": s.start_reason,
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
    # The version decides which fields are required, so it is read before they are
    # checked (a newer record is refused for its version, not for its new fields).
    version = RECORD_VERSION
    if isinstance(record, Mapping) and "version" in record:
        version = _version(record["version"])
    v2 = version >= 2
    r = Fields(record, "", {1: _TOP_KEYS_V1, 2: _TOP_KEYS_V2, 3: _TOP_KEYS_V3, 4: _TOP_KEYS_V4,
                         5: _TOP_KEYS_V5}.get(version, _TOP_KEYS))
    turns = [_turn_from_record(item, f"turns[{i}]")
             for i, item in enumerate(r.array("turns"))]
    segments = [_segment_from_record(item, f"segments[{i}]", v2)
                for i, item in enumerate(r.array("segments"))]
    tm = Fields(r.value("timings"), "timings", _TIMING_KEYS)
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
    if v2:
        t.parent_id = r.opt_text("parent_id")
        t.children = text_list(r.value("children"), "children")
        t.trainable = r.boolean("trainable")
        t.metadata = _metadata(r.value("metadata"))
    if version >= 3:
        t.reward_source = r.opt_choice("reward_source", RewardSource)
    if version >= 4:
        t.kv_across_updates = r.choice("kv_across_updates", KVAcrossUpdates)
        span = r.value("policy_span")
        stored = None if span is None else int_list(span, "policy_span")
        derived = t.policy_span
        if stored != (None if derived is None else list(derived)):
            raise RecordError(f"policy_span: {span!r:.80} is not the span of the versions "
                              f"that sampled its tokens ({derived})")
    if version >= 5:
        rewards_from_record(r, t)
    if version >= 6:
        t.resumed = [_resume_point(item, f"resumed[{i}]")
                     for i, item in enumerate(r.array("resumed"))]
    _check_invariants(t)
    _check_links(t)
    if r.boolean("infra_failure") != t.infra_failure:
        raise RecordError(f"infra_failure: must be {t.infra_failure} for status "
                          f"{t.status.value!r}")
    if r.integer("output_tokens") != t.output_tokens:
        raise RecordError(f"output_tokens: {record['output_tokens']} is not the sum of the "
                          f"turns' output_tokens ({t.output_tokens})")
    return t


def _resume_point(value: Any, path: str) -> ResumePoint:
    r = Fields(value, path, _RESUME_KEYS)
    return ResumePoint(r.integer("attempt"), r.integer("turn"), r.integer("rerun_calls"),
                       r.integer("discarded_turns"), r.integer("discarded_tokens"),
                       r.text("reason"))


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


def _version(value: Any) -> int:
    if type(value) is not int or value not in READ_VERSIONS:
        *first, last = map(str, READ_VERSIONS)
        known = f"{', '.join(first)} and {last}"
        raise RecordError(f"version: {value!r:.80} is not a record version this treadle "
                          f"reads (it reads {known})")
    return value


def _check_invariants(t: Trajectory) -> None:
    error = t.status is TrajectoryStatus.ERROR
    if error != (t.failure_stage is not None):
        raise RecordError(f"failure_stage: must be set exactly when status is 'error' "
                          f"(status {t.status.value!r}, failure_stage "
                          f"{None if t.failure_stage is None else t.failure_stage.value!r})")
    if error and t.reward is not None:
        raise RecordError(f"reward: must be null for status 'error' (an infrastructure "
                          f"failure has no reward), got {t.reward!r}")
    if t.reward_source is not None and t.reward is None:
        raise RecordError(f"reward_source: must be null for a trajectory without a reward, "
                          f"got {t.reward_source.value!r}")
    if t.trainable is False:
        # A frozen sub-agent's tokens are context for its parent, never trained: a
        # mask-1 token would reach the loss through a converter that trusts the mask.
        for i, seg in enumerate(t.segments):
            for j, m in enumerate(seg.loss_mask):
                if m != 0:
                    raise RecordError(f"segments[{i}].loss_mask[{j}]: must be 0 in a "
                                      f"frozen trajectory (trainable false), got {m!r}")


def _check_links(t: Trajectory) -> None:
    if t.parent_id is not None:
        if not isinstance(t.parent_id, str) or not t.parent_id:
            raise RecordError(f"parent_id: must be a non-empty string or null, "
                              f"got {t.parent_id!r:.80}")
        if t.parent_id == t.trajectory_id:
            raise RecordError(f"parent_id: {t.parent_id!r:.80} is the trajectory's own id")
    if not isinstance(t.children, list):
        raise RecordError(f"children: must be an array of strings, got {t.children!r:.80}")
    seen: set[str] = set()
    for i, child in enumerate(t.children):
        if not isinstance(child, str) or not child:
            raise RecordError(f"children[{i}]: must be a non-empty string, got {child!r:.80}")
        if child == t.trajectory_id:
            raise RecordError(f"children[{i}]: {child!r:.80} is the trajectory's own id")
        if child in seen:
            raise RecordError(f"children[{i}]: {child!r:.80} is listed twice")
        seen.add(child)


def _turn_to_record(turn: Turn) -> dict[str, Any]:
    call = turn.tool_call
    out = {
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
    if turn.constraint is not None:
        out["constraint"] = _constraint_to_record(turn.constraint)
    return out


def _constraint_to_record(constraint: OutputConstraint) -> dict[str, Any]:
    match constraint:
        case JsonSchemaConstraint(schema=schema, name=name):
            return {"kind": constraint.kind.value, "name": name,
                    "schema": json_value(dict(schema), "constraint.schema")}
        case JsonObjectConstraint():
            return {"kind": constraint.kind.value}


def _constraint_from_record(value: Any, path: str) -> OutputConstraint:
    kind_value = value.get("kind") if isinstance(value, dict) else None
    kind = next((k for k in ConstraintKind if k.value == kind_value), None)
    if kind is None:
        raise RecordError(f"{path}.kind: must be one of "
                          f"{', '.join(k.value for k in ConstraintKind)}, got {kind_value!r:.80}")
    r = Fields(value, path, _CONSTRAINT_KEYS[kind])
    if kind is ConstraintKind.JSON_OBJECT:
        return JsonObjectConstraint()
    schema = r.value("schema")
    if not isinstance(schema, dict):
        raise RecordError(f"{path}.schema: must be a JSON object")
    return JsonSchemaConstraint(json_value(schema, f"{path}.schema"), r.opt_text("name"))


def _turn_from_record(value: Any, path: str) -> Turn:
    constrained = isinstance(value, dict) and "constraint" in value
    r = Fields(value, path, _TURN_KEYS | {"constraint"} if constrained else _TURN_KEYS)
    call_value = r.value("tool_call")
    call = None
    if call_value is not None:
        c = Fields(call_value, f"{path}.tool_call", _TOOL_KEYS)
        arguments = c.value("arguments")
        if not isinstance(arguments, dict):
            raise RecordError(f"{path}.tool_call.arguments: must be a JSON object")
        call = ToolCall(name=c.text("name"), arguments=dict(arguments),
                        latency_s=c.number("latency_s"),
                        output_tokens=c.integer("output_tokens"), error=c.opt_text("error"))
    return Turn(index=r.integer("index"), output_tokens=r.integer("output_tokens"),
                engine_id=r.opt_text("engine_id"), tool_call=call,
                queued_s=r.number("queued_s"), generating_s=r.number("generating_s"),
                policy_version=r.integer("policy_version"),
                constraint=_constraint_from_record(r.value("constraint"), f"{path}.constraint")
                if constrained else None)


def _segment_from_record(value: Any, path: str, v2: bool) -> TokenSegment:
    r = Fields(value, path, _SEGMENT_KEYS if v2 else _SEGMENT_KEYS_V1)
    seg = TokenSegment(
        prompt_ids=int_list(r.value("prompt_ids"), f"{path}.prompt_ids"),
        response_ids=int_list(r.value("response_ids"), f"{path}.response_ids"),
        loss_mask=int_list(r.value("loss_mask"), f"{path}.loss_mask"),
        logprobs=float_list(r.value("logprobs"), f"{path}.logprobs"),
        policy_versions=int_list(r.value("policy_versions"), f"{path}.policy_versions"))
    if v2:
        seg.start_turn = r.integer("start_turn")
        seg.start_reason = r.text("start_reason", non_empty=True)
    try:
        seg.validate()
    except ValueError as e:
        raise RecordError(f"{path}: {e}") from None
    return seg


def _metrics(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise RecordError("metrics: must be a JSON object of numbers")
    return {str(k): as_number(v, f"metrics.{k}") for k, v in value.items()}


def _metadata(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"metadata: must be a JSON object, got {type(value).__name__}")
    out: dict[str, Any] = json_value(value, "metadata")
    return out

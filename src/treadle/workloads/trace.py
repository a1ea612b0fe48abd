"""Workload traces: one trajectory per JSONL line, loaded with strict validation.

Format (UTF-8, one JSON object a line, blank lines skipped)::

    {"id": "coding-g0000-r00", "group": "coding-g0000", "prompt_tokens": 812,
     "turns": [{"output_tokens": 2310, "tool_latency_s": 0.37, "tool_output_tokens": 96},
               {"output_tokens": 1544, "tool_latency_s": 0.0, "tool_output_tokens": 0}]}

Rules `load_trace` enforces, each failure a `TraceError` naming the file, the
1-based line and the field (turns are indexed from 0, as in JSON):

* every line is a JSON object with ``id`` and ``group`` (non-empty strings),
  ``prompt_tokens`` (integer >= 1) and ``turns`` (a non-empty list);
* every turn has ``output_tokens`` (integer >= 1), ``tool_latency_s`` (a finite
  number >= 0; an integer is accepted) and ``tool_output_tokens`` (integer >= 0);
  JSON booleans and integral floats such as ``12.0`` are not integers here;
* the last turn's ``tool_latency_s`` and ``tool_output_tokens`` are 0 — a trace
  that says a tool ran after the final turn is inconsistent, so it is rejected
  rather than silently repaired;
* ids are unique across the file; the file holds at least one trajectory;
* unknown extra keys, on a line or in a turn, are ignored (forward compatible).

The workload's name is not stored: `load_trace` names it after the file's stem.
`dump_trace` followed by `load_trace` gives back equal trajectories, floats
included (JSON writes the shortest repr that reads back to the same double).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from treadle.errors import InputError
from treadle.workloads.spec import TrajectorySpec, TurnSpec, Workload

__all__ = ["TraceError", "dump_trace", "load_trace", "spec_from_record"]


class TraceError(InputError):
    """A trace that does not follow the format. `line` is 1-based (0: the file as a
    whole); `field` is a path such as ``turns[3].tool_latency_s``, or "" when the
    whole line is at fault. The message is one line:
    ``trace.jsonl:12: field 'turns[3].tool_latency_s': must be >= 0, got -1.0``."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        where = f"{path}:{line}: "
        super().__init__(where + (f"field {field!r}: {problem}" if field else problem))
        self.path = path
        self.line = line
        self.field = field
        self.problem = problem

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, int, str, str]]:
        # The default pickling replays `args` (the message) into __init__.
        return (TraceError, (self.path, self.line, self.field, self.problem))


def _show(value: object) -> str:
    # Values come from untrusted files: keep the message to one short line.
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Line:
    """Validation helpers bound to one line of one file."""

    def __init__(self, path: str, line: int) -> None:
        self.path = path
        self.line = line

    def error(self, field: str, problem: str) -> TraceError:
        return TraceError(self.path, self.line, field, problem)

    def get(self, obj: dict[str, Any], key: str, prefix: str) -> Any:
        if key not in obj:
            raise self.error(prefix + key, "missing")
        return obj[key]

    def string(self, obj: dict[str, Any], key: str) -> str:
        value = self.get(obj, key, "")
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {type(value).__name__} {_show(value)}")
        if not value:
            raise self.error(key, "must not be empty")
        return value

    def integer(self, obj: dict[str, Any], key: str, prefix: str, minimum: int) -> int:
        value = self.get(obj, key, prefix)
        # bool is a subclass of int in Python; `true` is not a token count.
        if not isinstance(value, int) or isinstance(value, bool):
            kind = type(value).__name__
            raise self.error(prefix + key, f"must be an integer, got {kind} {_show(value)}")
        if value < minimum:
            raise self.error(prefix + key, f"must be >= {minimum}, got {value}")
        return value

    def seconds(self, obj: dict[str, Any], key: str, prefix: str) -> float:
        value = self.get(obj, key, prefix)
        if not isinstance(value, int | float) or isinstance(value, bool):
            kind = type(value).__name__
            raise self.error(prefix + key, f"must be a number, got {kind} {_show(value)}")
        # Python's json reads NaN and Infinity; no clock can use either.
        if not math.isfinite(value):
            raise self.error(prefix + key, f"must be finite, got {value}")
        if value < 0:
            raise self.error(prefix + key, f"must be >= 0, got {value}")
        return float(value)


def _turn(check: _Line, raw: Any, index: int, last: bool) -> TurnSpec:
    prefix = f"turns[{index}]."
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise check.error(f"turns[{index}]", f"must be an object, got {kind} {_show(raw)}")
    output = check.integer(raw, "output_tokens", prefix, 1)
    latency = check.seconds(raw, "tool_latency_s", prefix)
    observation = check.integer(raw, "tool_output_tokens", prefix, 0)
    if last and latency != 0:
        raise check.error(prefix + "tool_latency_s", f"must be 0 on the last turn, got {latency}")
    if last and observation != 0:
        raise check.error(
            prefix + "tool_output_tokens", f"must be 0 on the last turn, got {observation}"
        )
    return TurnSpec(output, latency, observation)


def _trajectory(check: _Line, text: str) -> TrajectorySpec:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise check.error("", f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        # Integers beyond Python's digit limit, nesting beyond the recursion limit.
        problem = " ".join(str(exc).split()) or type(exc).__name__
        raise check.error("", f"malformed JSON: {problem[:100]}") from None
    return _from_object(check, raw)


def spec_from_record(raw: Any, *, source: str = "trace", line: int = 1) -> TrajectorySpec:
    """One trace line already parsed from JSON; TraceError naming `source`:`line`."""
    return _from_object(_Line(source, line), raw)


def _from_object(check: _Line, raw: Any) -> TrajectorySpec:
    if not isinstance(raw, dict):
        raise check.error("", f"must be a JSON object, got {type(raw).__name__}")
    traj_id = check.string(raw, "id")
    group_id = check.string(raw, "group")
    prompt = check.integer(raw, "prompt_tokens", "", 1)
    turns = check.get(raw, "turns", "")
    if not isinstance(turns, list):
        raise check.error("turns", f"must be a list, got {type(turns).__name__} {_show(turns)}")
    if not turns:
        raise check.error("turns", "must hold at least one turn")
    specs = tuple(_turn(check, t, i, i == len(turns) - 1) for i, t in enumerate(turns))
    return TrajectorySpec(traj_id, group_id, prompt, specs)


def load_trace(path: str | Path) -> Workload:
    """Read and validate a JSONL trace (rules in the module docstring).

    Raises TraceError on the first problem, OSError if the file cannot be read.
    The whole file is read into memory: fine up to millions of trajectories.
    """
    name = str(path)
    first_line: dict[str, int] = {}
    trajectories: list[TrajectorySpec] = []
    # Read bytes and decode line by line, so a bad byte is reported with its line.
    with open(path, "rb") as f:
        for number, data in enumerate(f, start=1):
            check = _Line(name, number)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise check.error("", f"not valid UTF-8 at byte {exc.start}") from None
            if not text.strip():
                continue
            spec = _trajectory(check, text)
            if spec.traj_id in first_line:
                problem = f"duplicate id {_show(spec.traj_id)} (first on line "
                raise check.error("id", problem + f"{first_line[spec.traj_id]})")
            first_line[spec.traj_id] = number
            trajectories.append(spec)
    if not trajectories:
        raise TraceError(name, 0, "", "no trajectories in the file")
    return Workload(Path(path).stem, tuple(trajectories))


def dump_trace(workload: Workload, path: str | Path) -> None:
    """Write `workload` as a JSONL trace, one trajectory a line, in order.

    Overwrites `path`. The output loads back with `load_trace` to equal
    trajectories; the workload's name is not written.
    """
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for t in workload.trajectories:
            record = {
                "id": t.traj_id,
                "group": t.group_id,
                "prompt_tokens": t.prompt_tokens,
                "turns": [
                    {
                        "output_tokens": u.output_tokens,
                        # float(): an int latency would otherwise be written as
                        # an int and read back as one, of another type.
                        "tool_latency_s": float(u.tool_latency_s),
                        "tool_output_tokens": u.tool_output_tokens,
                    }
                    for u in t.turns
                ],
            }
            f.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")

"""`load_workload`: a built-in synthetic workload or a trace file, by name."""

from __future__ import annotations

from pathlib import Path

from treadle.errors import UsageError
from treadle.workloads.spec import Workload
from treadle.workloads.synthetic import WORKLOADS, generate
from treadle.workloads.trace import TraceError, load_trace


def load_workload(name: str, trajectories: int, seed: int, max_context: int) -> Workload:
    """`name` is one of `WORKLOADS` (generated: `trajectories`, `seed`, capped at
    `max_context` tokens) or the path of a JSONL trace. UsageError for anything else,
    an unreadable file or a malformed trace (its message names the file, line and
    field)."""
    if name in WORKLOADS:
        try:
            return generate(name, trajectories, seed=seed, max_context=max_context)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    path = Path(name)
    if not path.exists():
        raise UsageError(f"--workload {name!r}: not one of {', '.join(WORKLOADS)} and no "
                         "such trace file")
    try:
        return load_trace(path)
    except TraceError as exc:
        raise UsageError(str(exc)) from exc
    except OSError as exc:
        raise UsageError(f"--workload {name!r}: cannot read it ({exc.strerror or exc})") from exc


__all__ = ["load_workload"]

"""`load_workload`: a generated workload (a built-in suite or a shape) or a trace file,
by name; `generate_named` for the generated ones alone."""

from __future__ import annotations

from pathlib import Path

from treadle.errors import UsageError
from treadle.workloads.shapes import SHAPES, generate_shape
from treadle.workloads.spec import Workload
from treadle.workloads.synthetic import WORKLOADS, generate
from treadle.workloads.trace import TraceError, load_trace

# Every name a generator answers to: the four suites treadle's defaults were chosen on,
# then the shapes nothing was tuned on (`shapes`).
GENERATED: tuple[str, ...] = (*WORKLOADS, *SHAPES)


def generate_named(name: str, trajectories: int, *, seed: int = 0, group_size: int = 16,
                   max_context: int = 40960, sample: int = 0) -> Workload:
    """The workload `name` (one of `GENERATED`) generates: `synthetic.generate` for a
    suite, `shapes.generate_shape` for a shape; same arguments, same workload
    (`sample` > 0: the same prompts sampled again). ValueError for an unknown name
    or a count the generator refuses."""
    if name in SHAPES:
        return generate_shape(name, trajectories, seed=seed, group_size=group_size,
                              max_context=max_context, sample=sample)
    if name in WORKLOADS:
        return generate(name, trajectories, seed=seed, group_size=group_size,
                        max_context=max_context, sample=sample)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(GENERATED)}")


def load_workload(name: str, trajectories: int, seed: int, max_context: int) -> Workload:
    """`name` is one of `GENERATED` (generated: `trajectories`, `seed`, capped at
    `max_context` tokens) or the path of a JSONL trace. UsageError for anything else,
    an unreadable file or a malformed trace (its message names the file, line and
    field)."""
    if name in GENERATED:
        try:
            return generate_named(name, trajectories, seed=seed, max_context=max_context)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    path = Path(name)
    if not path.exists():
        raise UsageError(f"--workload {name!r}: not one of {', '.join(GENERATED)} and no "
                         "such trace file")
    try:
        return load_trace(path)
    except TraceError as exc:
        raise UsageError(str(exc)) from exc
    except OSError as exc:
        raise UsageError(f"--workload {name!r}: cannot read it ({exc.strerror or exc})") from exc

__all__ = ["GENERATED", "generate_named", "load_workload"]

"""What each trajectory of a workload will do, in counts: the data every driver replays.

A `Workload` is a fixed list of `TrajectorySpec`s, each the script of one agent
episode: its prompt length and, turn by turn, the tokens the model samples, the
latency of the tool call that follows and the observation tokens that call
appends. A driver (the simulator, the live runtime's replay, the service's replay
jobs) decides *when* things happen; the workload decides only *what* happens, so
every scheduler replays the very same episodes.

Workloads come from `treadle.workloads.synthetic.generate` (seeded synthetic
suites) or from a JSONL trace (`treadle.workloads.trace.load_trace` / `dump_trace`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Percentiles", "TrajectorySpec", "TurnSpec", "Workload", "WorkloadStats"]


# -- data --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One LLM turn and the tool call after it. Raises ValueError when a count is
    out of range; the last turn of a trajectory has both tool fields 0."""

    output_tokens: int  # tokens the model samples in this turn (>= 1)
    tool_latency_s: float  # latency of the tool call after this turn; 0 for the last turn
    tool_output_tokens: int  # observation tokens appended after the tool call; 0 for the last

    def __post_init__(self) -> None:
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        # `not >= 0` also rejects NaN, which would poison every clock it touches.
        if not (self.tool_latency_s >= 0 and math.isfinite(self.tool_latency_s)):
            raise ValueError(f"tool_latency_s must be finite and >= 0, got {self.tool_latency_s}")
        if self.tool_output_tokens < 0:
            raise ValueError(f"tool_output_tokens must be >= 0, got {self.tool_output_tokens}")


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    """The script of one episode. Raises ValueError without turns, with a prompt
    under one token, or with tool fields on the last turn."""

    traj_id: str  # unique within its workload
    group_id: str  # GRPO group (the prompt); siblings share it
    prompt_tokens: int  # initial context length (>= 1)
    # At least one. Every turn but the last is followed by a tool call (which may
    # take 0 s and return nothing); the last has both tool fields 0.
    turns: tuple[TurnSpec, ...]

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"{self.traj_id}: prompt_tokens {self.prompt_tokens} is < 1")
        if not self.turns:
            raise ValueError(f"{self.traj_id}: a trajectory needs at least one turn")
        last = self.turns[-1]
        if last.tool_latency_s != 0 or last.tool_output_tokens != 0:
            raise ValueError(f"{self.traj_id}: the last turn must have no tool call")

    @property
    def output_tokens(self) -> int:
        """Tokens the model samples over all turns."""
        return sum(t.output_tokens for t in self.turns)

    @property
    def tool_time_s(self) -> float:
        """Seconds spent inside tool calls."""
        return math.fsum(t.tool_latency_s for t in self.turns)

    @property
    def context_tokens(self) -> int:
        """Final context length: prompt, every output and every observation."""
        return self.prompt_tokens + sum(t.output_tokens + t.tool_output_tokens for t in self.turns)

    @property
    def num_turns(self) -> int:
        return len(self.turns)


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Nearest-rank percentiles (each one an observed value) and the mean."""

    p50: float
    p90: float
    p99: float
    max: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        """Raises ValueError on an empty sequence."""
        if not values:
            raise ValueError("percentiles of an empty sequence")
        ordered = sorted(values)

        def rank(p: float) -> float:
            # Nearest rank: the smallest value with at least p% of the data at or
            # below it. No interpolation, so a hand-built test can predict it.
            return ordered[max(0, math.ceil(p / 100.0 * len(ordered)) - 1)]

        return cls(rank(50), rank(90), rank(99), ordered[-1], math.fsum(ordered) / len(ordered))


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """Summary of a workload; percentiles are over trajectories."""

    trajectories: int
    groups: int  # distinct group ids
    total_turns: int
    tool_calls: int  # turns followed by a tool call: all but each trajectory's last
    total_output_tokens: int
    mean_tool_latency_s: float  # over tool calls, not trajectories; 0.0 without calls
    output_tokens: Percentiles  # per-trajectory sampled tokens
    turns: Percentiles  # per-trajectory turn count
    tool_time_s: Percentiles  # per-trajectory seconds in tool calls
    context_tokens: Percentiles  # per-trajectory final context length


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, ordered set of trajectories. Raises ValueError when empty or when
    two trajectories share an id (the simulator keys everything by id)."""

    name: str
    trajectories: tuple[TrajectorySpec, ...]

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ValueError(f"workload {self.name!r} has no trajectories")
        seen: set[str] = set()
        for t in self.trajectories:
            if t.traj_id in seen:
                raise ValueError(f"workload {self.name!r}: duplicate trajectory id {t.traj_id!r}")
            seen.add(t.traj_id)

    def stats(self) -> WorkloadStats:
        trajs = self.trajectories
        latencies = [turn.tool_latency_s for t in trajs for turn in t.turns[:-1]]
        return WorkloadStats(
            trajectories=len(trajs),
            groups=len({t.group_id for t in trajs}),
            total_turns=sum(t.num_turns for t in trajs),
            tool_calls=len(latencies),
            total_output_tokens=sum(t.output_tokens for t in trajs),
            mean_tool_latency_s=math.fsum(latencies) / len(latencies) if latencies else 0.0,
            output_tokens=Percentiles.of([t.output_tokens for t in trajs]),
            turns=Percentiles.of([t.num_turns for t in trajs]),
            tool_time_s=Percentiles.of([t.tool_time_s for t in trajs]),
            context_tokens=Percentiles.of([t.context_tokens for t in trajs]),
        )

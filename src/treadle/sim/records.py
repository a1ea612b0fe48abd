"""What the simulator's driver (`sim.cluster`) keeps of each trajectory, truth
included, and what one simulated run measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.sim.kernel import Handle
from treadle.sim.timeline import EngineInfo, Span
from treadle.workloads import TrajectorySpec


@dataclass(slots=True)
class SimTrajectory:
    """The driver's view of one trajectory, truth included."""

    spec: TrajectorySpec
    turn: int = 0  # index of the current turn
    turn_done: float = 0.0  # tokens of the current turn generated so far
    context: float = 0.0  # tokens in its context now
    new_tokens: float = 0.0  # tokens not yet in any KV cache (need prefill)
    ready_at: float = 0.0  # when its current turn became ready to run
    queue_s: float = 0.0  # total time ready but not generating
    finished_at: float | None = None  # when its last turn finished
    kv_arrives: tuple[str, float, float] | None = None  # (engine, tokens, time) of a migration
    deferred: Handle | None = None  # an admission waiting for its migrated KV to land
    span_start: float = 0.0  # start of the span being recorded
    sampled: int = 0  # output tokens of its finished turns
    tool: Handle | None = None  # its tool call's return, while one runs
    first_version: int | None = None  # policy version when it first joined an engine


@dataclass(slots=True)
class SimResult:
    """What one simulated run measured."""

    makespan_s: float
    output_tokens: int
    gpus: int
    engine_gpu_busy_s: float  # Σ over engines of busy time × tp
    longest_traj_id: str
    longest_queue_s: float  # queueing delay of the longest trajectory
    preemptions: int  # scheduler-initiated pauses
    kv_evictions: int  # engine-initiated evictions (out of KV cache)
    migrations: int
    reconfigurations: int  # engines added after the start
    events: int  # kernel callbacks fired
    trace_digest: str  # sha256 of the event trace (determinism checks)
    spans: list[Span] = field(default_factory=list)  # for the timeline, if recorded
    engines: list[EngineInfo] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def utilisation(self) -> float:
        denom = self.gpus * self.makespan_s
        return self.engine_gpu_busy_s / denom if denom > 0 else 0.0

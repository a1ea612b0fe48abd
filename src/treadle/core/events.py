"""What the scheduler hears (events) and what it says (decisions).

A driver — the live asyncio runtime or the discrete-event simulator — feeds events
to `Scheduler.on_event` in time order and carries out the decisions that
`Scheduler.decide` returns. Time is always an argument (seconds on the driver's
clock); nothing here reads a clock.

Priorities follow vLLM's convention: a *lower* value runs first.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- events ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrajectoryArrived:
    """A new trajectory whose first turn is ready to run."""

    traj_id: str  # unique trajectory id
    group_id: str  # GRPO group (the task); siblings share it
    prompt_tokens: int  # initial context length
    # A judge's call (`treadle.rewards`): ranked after every rollout turn, the first
    # to be preempted (`scheduler.JUDGE_RANK`).
    judge: bool = False
    # Its own staleness bound in versions (its job's `max_staleness`), which a policy
    # weighing staleness uses in place of its own; None: the policy's.
    max_staleness: int | None = None


@dataclass(frozen=True, slots=True)
class TurnFinished:
    """An engine finished a turn. `context_tokens` counts everything in the
    trajectory's context after this turn (prompt, all outputs, all observations)."""

    traj_id: str
    engine_id: str  # the engine that generated the turn
    output_tokens: int  # tokens sampled in this turn
    context_tokens: int  # context length after the turn
    final: bool  # True: no tool call follows; the trajectory is done


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    """The trajectory's tool call began; its engine slot is free until it returns."""

    traj_id: str


@dataclass(frozen=True, slots=True)
class ToolCallFinished:
    """The tool returned; the next turn is ready to run (unless `final`)."""

    traj_id: str
    latency_s: float  # how long the call took
    output_tokens: int  # observation tokens appended to the context
    final: bool = False  # True: the tool ended the episode (an answer); no turn follows


@dataclass(frozen=True, slots=True)
class TurnPreempted:
    """The engine evicted a running turn on its own (out of KV cache). The turn's
    tokens so far are kept by the driver; the turn must be admitted again."""

    traj_id: str
    engine_id: str
    output_tokens_so_far: int  # tokens of this turn generated before eviction


@dataclass(frozen=True, slots=True)
class TrajectoryEnded:
    """The trajectory ended for a reason other than its last turn finishing
    (limits, cancel, infrastructure failure); it will send no more events."""

    traj_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class EngineAdded:
    """An engine is up and accepting turns."""

    engine_id: str
    tp: int  # tensor-parallel degree (GPUs it occupies)
    max_batch: int  # most sequences it runs at once
    kv_capacity_tokens: int  # KV cache size in tokens


@dataclass(frozen=True, slots=True)
class EngineRemoved:
    """The engine is gone after a drain: nothing was running on it."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class EngineDraining:
    """An operator asked to retire the engine: admit nothing more to it and send its
    queued turns elsewhere; the driver removes it once idle (`EngineRemoved`)."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine died. Every turn that was running or admitted on it is lost and
    must be re-admitted elsewhere (with a full re-prefill)."""

    engine_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class PolicyUpdated:
    """The engines serve the weights of policy `version` from now on: every token
    sampled after this event carries it. Versions only grow. A trajectory that has
    not finished continues under the new weights, its earlier tokens keeping their
    versions; a driver that restarts or drops some instead ends them first
    (`TrajectoryEnded`). Where the update cost the engines their KV (a pause that
    aborts the running turns, a colocated trainer that takes the memory), the driver
    reports each running turn's loss as usual (`TurnPreempted`)."""

    version: int


Event = (
    TrajectoryArrived
    | TurnFinished
    | ToolCallStarted
    | ToolCallFinished
    | TurnPreempted
    | TrajectoryEnded
    | EngineAdded
    | EngineDraining
    | EngineRemoved
    | EngineFailed
    | PolicyUpdated
)

# -- decisions -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Start the trajectory's ready turn on this engine now."""

    traj_id: str
    engine_id: str
    priority: float  # lower runs first; engines with priority scheduling honour it


@dataclass(frozen=True, slots=True)
class Preempt:
    """Pause the trajectory's running turn; its KV stays in the engine's prefix
    cache. The scheduler admits it again later (it is back in a queue)."""

    traj_id: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move a trajectory that is inside a tool call to another engine, taking its
    KV along. Only legal during the tool-call gap."""

    traj_id: str
    src_engine_id: str
    dst_engine_id: str


@dataclass(frozen=True, slots=True)
class AddEngine:
    """Start a new engine of this TP degree; an `EngineAdded` follows when it is up."""

    tp: int


@dataclass(frozen=True, slots=True)
class DrainEngine:
    """Admit nothing more to the engine; remove it once idle (`EngineRemoved`)."""

    engine_id: str


Decision = Admit | Preempt | Migrate | AddEngine | DrainEngine

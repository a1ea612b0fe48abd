"""The wire models of what the service shows of itself (pydantic): the job list, the
engine pool, the service's status and its recent history, a job's GRPO groups and
one trajectory's record, summed up. They are what the dashboard (`GET /dashboard`,
docs/dashboard.md) polls, and any client may read them; requests are in `schemas`.

Times: `at`, `read_at`, `created_at`, `started_at` and `finished_at` of jobs are
Unix seconds (the store's clock); a trajectory's `started_at`/`finished_at` and
`oldest_running_s` are the service's runtime clock (modelled seconds when it runs
emulated engines at a time scale), as in the trajectory record.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class JobSummary(BaseModel):
    """A job as the list shows it (`GET /v1/jobs`); `GET /v1/jobs/{id}` adds the rest."""

    job_id: str
    status: str  # queued | running | completed | cancelled | failed
    # Why it was cancelled or failed; for a job completed with infrastructure
    # failures, how many (a completed job is not a clean one unless this is None).
    reason: str | None
    planned: int
    delivered: int  # finished trajectories; the NDJSON stream's last sequence number
    counts: dict[str, int]  # trajectories per status
    # Trajectories that ended in an infrastructure failure (status error: an engine,
    # sandbox, tool server or treadle itself failed): excluded from training.
    infrastructure_failures: int
    progress: float  # delivered / planned
    created_at: float
    started_at: float | None
    finished_at: float | None
    running: int  # trajectories in flight in this process now
    queued: int  # trajectories waiting for a slot in this process now
    owner: str | None = None  # the trainer run whose key submitted it (None: the admin)


class EngineLoadView(BaseModel):
    """An engine's load as its own metrics said at `read_at`."""

    running: int  # requests in its running batch
    waiting: int  # requests it holds waiting for a slot (or preempted)
    kv_usage: float  # fraction of its KV cache in use, 0.0-1.0
    read_at: float  # Unix seconds


class EngineView(BaseModel):
    """One engine of a pool (`GET /v1/engines`)."""

    engine_id: str
    label: str
    url: str | None  # the engine's base URL (None for an engine without one)
    tp: int
    max_batch: int
    kv_capacity_tokens: int
    calls_in_flight: int
    draining: bool
    pool: str = "policy"  # policy | frozen (EngineRequest.pool)
    policy_version: int = 0  # the weights its pool serves (stamped on its tokens)
    queued_turns: int = 0  # turns the scheduler holds in this engine's queue
    # draining: admits nothing more; unhealthy: its last health check or load read
    # failed (the runtime fails it after two missed checks in a row).
    health: Literal["healthy", "unhealthy", "draining"] = "healthy"
    # Its own metrics, read while the dashboard or a client watches (None: not read
    # yet, or the last read failed).
    load: EngineLoadView | None = None


class SandboxPoolView(BaseModel):
    """One suite's sandbox pool."""

    suite: str
    live: int  # sandboxes that exist or are being started (at most max_live)
    idle: int  # warm and unused
    in_use: int  # handed to trajectories
    waiting: int  # trajectories waiting for a sandbox
    created: int  # started since the service started
    max_live: int


class StatusSample(BaseModel):
    """The service over one sampling interval, ending at `at`."""

    at: float  # Unix seconds
    tokens_per_s: float  # tokens the engines sampled, per real second
    finished_per_s: float  # trajectories finished, per real second
    running: int  # trajectories in flight here at `at`
    queued: int  # trajectories waiting for a slot here at `at`
    # How long the oldest running trajectory has run (the runtime's clock; 0: none):
    # a batch's long tail is a few trajectories running on while the rest are done.
    oldest_running_s: float


class ServiceStatus(BaseModel):
    """`GET /v1/status` (the admin's: it counts every run's work, like /metrics)."""

    at: float  # Unix seconds
    running: int  # trajectories in flight here
    queued: int  # trajectories waiting for a slot here (every job)
    max_live: int  # trajectories that may run at once
    tokens_generated: int  # since the service started
    finished: dict[str, int]  # trajectories finished since the service started, by status
    failures: dict[str, int]  # infrastructure failures by stage
    sessions: int  # gateway sessions open
    policy_version: int
    paused: bool  # a weight update holds new engine calls
    sandboxes: list[SandboxPoolView]
    interval_s: float  # between samples
    series: list[StatusSample]  # the latest samples, oldest first


class GroupView(BaseModel):
    """One GRPO group of a job: its samples by repetition."""

    group_id: str
    task_id: str
    statuses: list[str]  # per repetition
    rewards: list[float | None]  # per repetition (None: unscored, or not finished)
    trajectory_ids: list[str]  # per repetition
    finished: int
    mean_reward: float | None  # over the scored samples
    reward_spread: float | None  # max - min over the scored (0: no GRPO signal)


class JobGroups(BaseModel):
    """`GET /v1/jobs/{id}/groups`: the job's first `limit` groups, in plan order."""

    job_id: str
    total: int  # groups in the job
    groups: list[GroupView]


class TurnView(BaseModel):
    index: int
    output_tokens: int
    engine_id: str | None
    policy_version: int
    queued_s: float
    generating_s: float
    tool: str | None  # the tool it called, if any
    tool_latency_s: float | None
    tool_error: str | None


class SegmentView(BaseModel):
    """One token segment: its sizes and the weights its sampled tokens came from."""

    start_turn: int
    start_reason: str
    prompt_tokens: int
    response_tokens: int
    sampled_tokens: int  # loss mask 1
    policy_versions: list[int]  # of its response tokens, each once, in order


class TrajectoryDetail(BaseModel):
    """`GET /v1/jobs/{id}/record`: one finished trajectory's record without its tokens
    (the NDJSON stream has them)."""

    job_id: str
    seq: int
    trajectory_id: str
    group_id: str
    repetition: int
    task_id: str
    status: str
    reason: str | None
    reward: float | None
    reward_source: str | None
    attempt: int
    prompt_tokens: int
    output_tokens: int
    policy_versions: list[int]  # of its turns, each once, in order
    llm_s: float
    tool_s: float
    queue_s: float
    started_at: float | None
    finished_at: float | None
    turns: list[TurnView]
    segments: list[SegmentView]


__all__ = ["EngineLoadView", "EngineView", "GroupView", "JobGroups", "JobSummary",
           "SandboxPoolView", "SegmentView", "ServiceStatus", "StatusSample",
           "TrajectoryDetail", "TurnView"]

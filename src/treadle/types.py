"""The trajectory data model shared by every layer.

A *task* is one prompt with its environment; a GRPO *group* is the ``n`` samples
(trajectories) of one task. A *trajectory* alternates LLM turns and tool calls and
ends with a terminal status. Its training record is token-exact: the ids and
logprobs the engine produced, never a re-tokenisation of text.

These are plain dataclasses: pydantic lives at the wire edges (service, config),
not here. The simulator fills only the counts (tokens per turn, tool latency); the
live runtime fills the token ids as well.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


class TrajectoryStatus(enum.Enum):
    """Where a trajectory stands. The last six are terminal."""

    PENDING = "pending"  # created, first turn not yet started
    RUNNING = "running"  # a turn or a tool call is in progress
    COMPLETED = "completed"  # the agent finished on its own (answer, no more tool calls)
    TRUNCATED = "truncated"  # hit the token budget (total or per-turn)
    MAX_TURNS = "max_turns"  # hit the turn limit
    TIMEOUT = "timeout"  # hit its wall-clock deadline
    ABORTED = "aborted"  # cancelled by the caller
    ERROR = "error"  # an infrastructure failure; `Trajectory.reason` says which

    @property
    def terminal(self) -> bool:
        return self not in (TrajectoryStatus.PENDING, TrajectoryStatus.RUNNING)


class FailureStage(enum.Enum):
    """Which boundary an infrastructure failure (status ERROR) came from, as in
    ProRL Agent's init/run/eval stages. An agent's own mistakes are not failures."""

    INIT = "init"  # the sandbox or the task's setup could not be brought up
    ENGINE = "engine"  # the inference engines failed (unreachable, timeouts, none left)
    TOOL = "tool"  # a tool's infrastructure failed (dead sandbox, unreachable server)
    EVAL = "eval"  # the reward function's infrastructure failed
    HARNESS = "harness"  # an external agent harness crashed, or could not be started
    RUNTIME = "runtime"  # treadle itself (a bug or a lost process); the reason says what


class RewardSource(enum.Enum):
    """What scored a trajectory: how far its reward can be trusted (docs/security.md)."""

    VERIFIER = "verifier"  # the suite's verifier (treadle's agent loop, or a harness
    # job's final answer in a fresh episode): the policy cannot write it
    EXIT_CODE = "exit_code"  # a harness job's exit status (0 → 1.0, 1 → 0.0)
    REWARD_FILE = "reward_file"  # a harness job's own reward file: the harness's word,
    # taken only where the job chose it
    OWNER = "owner"  # the reward the session's owner gave at its end (POST .../end),
    # or, for a sub-agent without one, its parent's
    RUBRIC = "rubric"  # its job's rubric (`treadle.rewards`): the verifier's parts and
    # the judges' verdicts, aggregated (`Trajectory.rewards` has each dimension)


class KVAcrossUpdates(enum.Enum):
    """What a trajectory that runs on across a weight update does with the KV cache
    of its context, computed under the old weights (a job's setting)."""

    RECOMPUTE = "recompute"  # computed again under the new weights: each token's
    # logprob is the new weights' over the whole context (the cost: one prefill)
    KEEP = "keep"  # reused while the engine holds it: no prefill, but tokens sampled
    # after the update attend to KV of the old weights (their logprobs are neither
    # version's)


class StaleChoice(enum.Enum):
    """What a continuous job does with a trajectory whose oldest sampled token falls
    out of its `max_staleness` (a job's setting)."""

    FLAG = "flag"  # handed out as is, flagged stale
    RESTART = "restart"  # run again from its prompt; its tokens so far are discarded
    CUT = "cut"  # its tokens sampled by versions out of the bound become context (loss
    # mask 0); the rest train. Needs token segments: one without is restarted


@dataclass(frozen=True, slots=True)
class GroupKey:
    """Identifies one trajectory inside its GRPO group."""

    group_id: str  # the task/prompt instance; siblings share it
    repetition: int  # 0..n-1 within the group


@dataclass(slots=True)
class Task:
    """One prompt with its environment."""

    task_id: str  # stable id of the prompt; also the GRPO group id
    prompt: str | list[dict[str, Any]]  # plain text or chat messages
    suite: str = ""  # task suite name (math, code, swe, ...); "" for ad-hoc tasks
    metadata: dict[str, Any] = field(default_factory=dict)  # suite-specific (answer, tests, ...)


@dataclass(slots=True)
class ToolCall:
    """One tool invocation between two LLM turns."""

    name: str  # tool name as the model wrote it
    arguments: dict[str, Any] = field(default_factory=dict)  # parsed JSON arguments
    latency_s: float = 0.0  # wall (or simulated) seconds from start to result
    output_tokens: int = 0  # tokens of the observation appended to the context
    error: str | None = None  # tool-side error shown to the model as an observation


class ConstraintKind(enum.Enum):
    """What an engine can be asked to decode under (structured output)."""

    JSON_SCHEMA = "json_schema"  # a JSON value valid against a given JSON schema
    JSON_OBJECT = "json_object"  # any JSON object


@dataclass(frozen=True, slots=True)
class JsonSchemaConstraint:
    """The reply is decoded as a JSON value valid against `schema` (every token is
    sampled from those the schema allows next)."""

    schema: Mapping[str, Any]  # the JSON schema, as the caller gave it
    name: str | None = None  # the caller's name for it (OpenAI's json_schema.name)
    kind: ClassVar[ConstraintKind] = ConstraintKind.JSON_SCHEMA


@dataclass(frozen=True, slots=True)
class JsonObjectConstraint:
    """The reply is decoded as a JSON object, of any shape."""

    kind: ClassVar[ConstraintKind] = ConstraintKind.JSON_OBJECT


# What a turn's reply was decoded under; None where it was sampled freely.
OutputConstraint = JsonSchemaConstraint | JsonObjectConstraint


@dataclass(slots=True)
class Turn:
    """One LLM generation, optionally followed by one tool call."""

    index: int  # 0-based position in the trajectory
    output_tokens: int  # tokens the model sampled in this turn
    engine_id: str | None = None  # engine that generated it (the last one, if preempted)
    tool_call: ToolCall | None = None  # the tool call this turn asked for, if any
    queued_s: float = 0.0  # waiting before the first token (scheduler + engine queues)
    generating_s: float = 0.0  # from first token (prefill included) to last token
    policy_version: int = 0  # weights version that sampled this turn
    # What the reply was decoded under (structured output: the harness's
    # response_format); None: sampled freely.
    constraint: OutputConstraint | None = None


@dataclass(slots=True)
class TokenSegment:
    """One prefix-consistent training sequence.

    Invariants (checked by `validate`): ``response_ids``, ``loss_mask``, ``logprobs``
    and ``policy_versions`` have the same length; ``logprobs`` is 0.0 wherever
    ``loss_mask`` is 0. A trajectory whose context is never edited has one segment;
    pruning or summarising produce several (`start_reason` says why each began).
    """

    prompt_ids: list[int] = field(default_factory=list)  # the context before the first turn
    response_ids: list[int] = field(default_factory=list)  # model + observation tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the model
    logprobs: list[float] = field(default_factory=list)  # engine logprobs, 0.0 at mask 0
    policy_versions: list[int] = field(default_factory=list)  # version per response token
    start_turn: int = 0  # index of the trajectory's turn whose context this segment begins
    # Why the segment began: "start" (the first), or why the context before it could not
    # be extended ("messages_edited", "messages_removed", "system_changed",
    # "tools_changed", "reply_edited": see treadle.agent.context).
    start_reason: str = "start"

    def validate(self) -> None:
        n = len(self.response_ids)
        lengths = (len(self.loss_mask), len(self.logprobs), len(self.policy_versions))
        if any(length != n for length in lengths):
            raise ValueError(
                f"segment lengths differ: response {n}, mask/logprobs/versions {lengths}")
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.logprobs, strict=True)):
            if m not in (0, 1):
                raise ValueError(f"loss_mask[{i}] = {m}, must be 0 or 1")
            if m == 0 and lp != 0.0:
                raise ValueError(f"logprobs[{i}] = {lp} where loss_mask is 0")


@dataclass(slots=True)
class Timings:
    """Where a trajectory's wall time went (seconds)."""

    llm_s: float = 0.0  # generating, prefill included
    tool_s: float = 0.0  # inside tool calls
    queue_s: float = 0.0  # waiting for an engine (scheduler queue, engine queue, preempted)
    started_at: float | None = None  # clock time of the first event
    finished_at: float | None = None  # clock time of the terminal status


class JudgementStatus(enum.Enum):
    """How one judged dimension of a rubric came out."""

    JUDGED = "judged"  # the judge answered with a verdict on the scale
    FAILED = "failed"  # no verdict within the retry budget: the reason says why
    SKIPPED = "skipped"  # not asked: a gate decided the reward already


@dataclass(slots=True)
class Judgement:
    """One judge's verdict on one dimension of a trajectory, with what it saw and
    said (the judge's own tokens: for audit, and to train the judge later)."""

    dimension: str  # the rubric's name for it
    status: JudgementStatus
    value: float | None  # the verdict mapped to [0, 1]; set exactly when JUDGED
    score: float | None  # the verdict on the judge's scale; set exactly when JUDGED
    reason: str  # the judge's stated reason (JUDGED), else why there is no value
    optional: bool  # the rubric trains on the trajectory without it
    judge: str  # which judge: its lane and model
    attempts: int  # calls made (0: cached or skipped)
    cached: bool  # the answer came from the cache (the same prompt judged before)
    prompt: str  # what the judge was shown
    reply: str  # its last reply ("" when none came)
    reply_ids: list[int] = field(default_factory=list)  # the reply's ids, where the
    # judge's lane returns them (token-level lanes)
    reply_logprobs: list[float] = field(default_factory=list)  # one per reply id

    @property
    def missing(self) -> bool:
        """A required dimension without a value: the trajectory cannot be scored."""
        return self.status is JudgementStatus.FAILED and not self.optional


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where one attempt of a trajectory took over from the attempt a restart ended
    (`treadle.agent.journal`): the record's `resumed`, one per restart it survived."""

    attempt: int  # the attempt that resumed (`Trajectory.attempt` then)
    turn: int  # completed turns it kept (0: it ran again from the prompt)
    rerun_calls: int = 0  # recorded tool calls run again to rebuild its sandbox
    discarded_turns: int = 0  # journaled turns it could not keep
    discarded_tokens: int = 0  # the tokens they had sampled
    reason: str = ""  # why it kept no more (empty: it kept every journaled turn)


@dataclass(slots=True)
class Trajectory:
    """One agent episode for one task sample."""

    trajectory_id: str  # unique; also the routing key for prefix-cache affinity
    key: GroupKey  # GRPO group and repetition
    prompt_tokens: int = 0  # length of the initial context
    turns: list[Turn] = field(default_factory=list)  # in order
    segments: list[TokenSegment] = field(default_factory=list)  # token-exact record (live runs)
    status: TrajectoryStatus = TrajectoryStatus.PENDING  # see TrajectoryStatus
    reason: str | None = None  # why it ended, for any status but COMPLETED
    failure_stage: FailureStage | None = None  # set exactly when status is ERROR
    reward: float | None = None  # None until scored; never invented for an ERROR
    metrics: dict[str, float] = field(default_factory=dict)  # reward parts, e.g. exact_match
    attempt: int = 0  # retries after an infrastructure failure
    timings: Timings = field(default_factory=Timings)  # split of wall time
    task_id: str = ""  # the task it samples (a group id may be job-qualified)
    # Sub-agents: the trajectory this one was a sub-agent of (None for a top-level
    # one), and the sub-agent trajectories this one started, in creation order.
    parent_id: str | None = None
    children: list[str] = field(default_factory=list)
    # False for a frozen sub-agent: its tokens are recorded with loss mask 0 and the
    # converters never train on it.
    trainable: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)  # the caller's, JSON-able
    # What scored it (set only with a reward); None: unscored, or not said (records
    # written before version 3, or a producer that does not say).
    reward_source: RewardSource | None = None
    # What its calls after a weight update did with KV cached before it (its job's
    # setting; records before version 4: recompute, as engines were reset then).
    kv_across_updates: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
    # A rubric's reward vector: each dimension's value (verified parts as measured,
    # judged parts in [0, 1]); None where a judge gave no verdict. Empty: no rubric.
    rewards: dict[str, float | None] = field(default_factory=dict)
    judgements: list[Judgement] = field(default_factory=list)  # the judged dimensions'
    # The restarts it survived, oldest first: where each attempt resumed (empty: it
    # ran once, or records before version 6).
    resumed: list[ResumePoint] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        """A required judged dimension has no verdict (a judge failed): it has no
        reward, and the converters leave it out of training."""
        return any(j.missing for j in self.judgements)

    @property
    def policy_span(self) -> tuple[int, int] | None:
        """The oldest and newest policy version that sampled its tokens (segment tokens
        with loss mask 1, and each turn's version: that of its last token); None when
        the model sampled nothing. One version unless it ran across an update."""
        versions = [t.policy_version for t in self.turns if t.output_tokens]
        for seg in self.segments:
            versions += [v for v, m in zip(seg.policy_versions, seg.loss_mask, strict=True)
                         if m]
        return (min(versions), max(versions)) if versions else None

    @property
    def infra_failure(self) -> bool:
        """True for an infrastructure failure: a trainer drops it, it is no reward 0."""
        return self.status is TrajectoryStatus.ERROR

    @property
    def output_tokens(self) -> int:
        """Tokens sampled by the model across all turns."""
        return sum(t.output_tokens for t in self.turns)

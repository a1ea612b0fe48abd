"""The service's wire schemas (pydantic): what a client sends and gets back.

Requests are strict — unknown fields are refused (a typo must not be silently
ignored), a value must have its JSON type (``"8"`` or ``false`` is not an integer)
and every range is checked — so a bad request is a 422 whose ``detail`` names each
bad field (``body.tasks.count``: "Input should be greater than 0"). Integers that
reach the store (seeds, policy versions, token counts) are bounded by SQLite's
and Parquet's 64-bit integers.
Finished trajectories are not modelled here: they travel as the store's record
(`treadle.store.record`, documented there), one JSON object per NDJSON line.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    field_validator,
    model_validator,
)

from treadle.service.continuous_schemas import ContinuousParams, continuous_refusals
from treadle.service.rubric_schemas import RubricParams
from treadle.service.views import JobSummary

MAX_TRAJECTORIES_PER_JOB = 65_536  # planned trajectories in one job, samples included
MAX_INT64 = (1 << 63) - 1  # the store's and the exports' integers
TRAINER_RUN = r"^[A-Za-z0-9._:/-]+$"  # a trainer run's name (shown in errors and views)


# A job's (or a session's) `KVAcrossUpdates`.
KVChoice = Annotated[Literal["recompute", "keep"], Field(
    description="what a trajectory that runs on across a weight update does with the KV "
                "of its context cached under the old weights: compute it again under the "
                "new ones, or keep it (no prefill; later tokens attend to the old "
                "weights' KV). Recorded in each trajectory")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SuiteTasks(_Strict):
    """Tasks of a suite: generated (`count`, `seed`) or given (`tasks`, the suite's
    JSONL records, see docs/suites.md)."""

    suite: str = Field(min_length=1, max_length=64, description="math, code, swe, search, stem")
    count: int | None = Field(default=None, gt=0, le=MAX_TRAJECTORIES_PER_JOB,
                              description="generate this many tasks")
    seed: int = Field(default=0, ge=0, le=MAX_INT64, description="seed of the generated tasks")
    tasks: list[dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=MAX_TRAJECTORIES_PER_JOB,
        description="task records in the suite's format")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="suite constructor options")

    @model_validator(mode="after")
    def _one_source(self) -> SuiteTasks:
        if (self.count is None) == (self.tasks is None):
            raise ValueError("give exactly one of 'count' (generated) and 'tasks' (records)")
        return self


class TraceTurn(BaseModel):
    """One turn of a trace line: `treadle.workloads.trace`'s format (the last turn's tool
    fields are 0; unknown keys are ignored, as in a trace file)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    output_tokens: int = Field(ge=1, le=1 << 40)
    tool_latency_s: float = Field(ge=0.0, le=7 * 86400.0, allow_inf_nan=False)
    tool_output_tokens: int = Field(ge=0, le=1 << 40)


class TraceLine(BaseModel):
    """One trajectory of a trace (`treadle.workloads.trace`); its whole context (prompt,
    outputs, observations) must fit the served model's window."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = Field(min_length=1, max_length=256)
    group: str = Field(min_length=1, max_length=256)
    prompt_tokens: int = Field(ge=1, le=1 << 40)
    turns: list[TraceTurn] = Field(min_length=1, max_length=4096)


class ReplayTasks(_Strict):
    """Workload trajectories replayed on the engines (counts only, synthetic tokens):
    a generated workload (`workload`, `trajectories`, `seed`: one of
    `treadle.workloads.load.GENERATED`, the four suites and the four shapes) or trace
    lines (`trace`)."""

    workload: Literal["coding", "search", "math", "swe",
                      "pareto", "bimodal", "flat", "short"] | None = None
    trajectories: int | None = Field(default=None, gt=0, le=MAX_TRAJECTORIES_PER_JOB)
    seed: int = Field(default=0, ge=0, le=MAX_INT64)
    group_size: int = Field(default=16, gt=0, le=1024)
    trace: list[TraceLine] | None = Field(default=None, min_length=1,
                                          max_length=MAX_TRAJECTORIES_PER_JOB)

    @model_validator(mode="after")
    def _one_source(self) -> ReplayTasks:
        if (self.workload is None) == (self.trace is None):
            raise ValueError("give exactly one of 'workload' and 'trace'")
        if self.workload is not None and self.trajectories is None:
            raise ValueError("'workload' needs 'trajectories'")
        return self


class SessionTasks(_Strict):
    """Sessions a harness makes through the gateway (`POST /v1/sessions` with this
    job's id): ``sessions`` GRPO groups (a count, or their ids) of
    `samples_per_task` sessions each."""

    sessions: int | list[str] = Field(
        description="how many groups (ids 0, 1, ...) or the groups' ids")

    @field_validator("sessions")
    @classmethod
    def _groups(cls, value: int | list[str]) -> int | list[str]:
        if isinstance(value, int):
            if not 0 < value <= MAX_TRAJECTORIES_PER_JOB:
                raise ValueError(f"from 1 to {MAX_TRAJECTORIES_PER_JOB} groups")
            return value
        if not value or len(value) > MAX_TRAJECTORIES_PER_JOB or len(set(value)) != len(value):
            raise ValueError("group ids must be 1 to 65,536 unique strings")
        for group in value:
            if not 0 < len(group) <= 256 or "/" in group:
                raise ValueError(f"group id {group[:40]!r}: 1 to 256 characters, no '/'")
        return value

    @property
    def group_ids(self) -> list[str]:
        return [str(g) for g in range(self.sessions)] if isinstance(self.sessions, int) \
            else list(self.sessions)


def _task_source(value: Any) -> str:
    """Which kind of tasks: a ``suite`` key means suite tasks, ``sessions`` sessions,
    anything else a replay (so a bad request's errors name the fields of the kind it
    meant)."""
    if isinstance(value, SuiteTasks) or (isinstance(value, dict) and "suite" in value):
        return "suite"
    if isinstance(value, SessionTasks) or (isinstance(value, dict) and "sessions" in value):
        return "sessions"
    return "replay"


class SamplingParams(_Strict):
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Base seed of every turn's sampling (agent.loop.Sampling.seed); None: unseeded.
    seed: int | None = Field(default=None, ge=0, le=MAX_INT64)


class LimitParams(_Strict):
    max_turns: int = Field(default=8, ge=1, le=1000)
    max_total_tokens: int = Field(default=4096, ge=2, le=1 << 20)
    max_tokens_per_turn: int = Field(default=1024, ge=1, le=1 << 20)
    deadline_s: float | None = Field(default=None, gt=0.0, le=7 * 86400.0)


class HarnessParams(_Strict):
    """A job's harness: each trajectory is a session driven by this harness command
    (configured at `treadle serve --harness NAME=CMD`), not by treadle's agent loop."""

    name: str = Field(min_length=1, max_length=64, description="a harness the service has")
    score: Literal["verifier", "exit_code", "reward_file", "auto"] = Field(
        default="verifier",
        description="how a finished run is scored, and so what the reward trusts: the "
                    "suite's verifier on its answer (auto: the same), its exit status, or "
                    "its own reward file — the harness's word, which a command it runs "
                    "unsandboxed can write too (docs/security.md)")


class JobRequest(_Strict):
    """`POST /v1/jobs`."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"tasks": {"workload": "math", "trajectories": 32, "group_size": 16}},
        {"tasks": {"trace": [{"id": "t1", "group": "g1", "prompt_tokens": 812, "turns": [
            {"output_tokens": 240, "tool_latency_s": 0.4, "tool_output_tokens": 31},
            {"output_tokens": 90, "tool_latency_s": 0, "tool_output_tokens": 0}]}]},
         "priority": 5},
        {"tasks": {"suite": "math", "count": 64, "seed": 3}, "samples_per_task": 16,
         "limits": {"max_turns": 4, "max_total_tokens": 8192}},
    ]})

    tasks: Annotated[Annotated[SuiteTasks, Tag("suite")] | Annotated[ReplayTasks, Tag("replay")]
                     | Annotated[SessionTasks, Tag("sessions")], Discriminator(_task_source)]
    samples_per_task: int = Field(default=1, ge=1, le=1024,
                                  description="the GRPO group size (suite tasks); tasks "
                                              "times samples is at most 65,536")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: LimitParams = Field(default_factory=LimitParams)
    min_policy_version: int = Field(
        default=0, ge=0, le=MAX_INT64,
        description="start no trajectory before the engines serve "
                                     "this policy version (set by a weight update)")
    max_policy_version: int | None = Field(
        default=None, ge=0, le=MAX_INT64,
        description="refuse the job (409) if the engines serve a later version, and end "
                    "its queued trajectories if they move past it; equal to "
                    "min_policy_version: exactly that version")
    trainer_run: str | None = Field(default=None, min_length=1, max_length=128,
                                    pattern=TRAINER_RUN,
                                    description="only weights this trainer run pushed "
                                                "(POST /v1/weights/update's trainer_run)")
    harness: HarnessParams | None = Field(
        default=None, description="run each trajectory with this harness through the "
                                  "gateway (suite tasks only)")
    chat_format: str | None = Field(default=None, min_length=1, max_length=64,
                                    description="the model family's chat format its "
                                                "trajectories are rendered in (suite "
                                                "tasks; default: the service's)")
    kv_across_updates: KVChoice = "recompute"
    rubric: RubricParams | None = Field(default=None, description="score each trajectory on "
                                        "these dimensions (suite tasks, harness runs, "
                                        "sessions)")
    continuous: ContinuousParams | None = Field(
        default=None, description="run until cancelled or a budget is spent; the trainer "
                                  "takes complete groups (POST /v1/jobs/{id}/take)")
    priority: int = Field(default=0, ge=-1000, le=1000,
                          description="higher starts first when trajectories queue")
    job_id: str | None = Field(default=None, min_length=1, max_length=128,
                               pattern=r"^[A-Za-z0-9._-]+$",
                               description="the caller's id (idempotency); default random; "
                                           "not '.' or '..', which no URL path can name")

    @field_validator("job_id")
    @classmethod
    def _addressable(cls, job_id: str | None) -> str | None:
        # A client puts the id in a URL path, where '.' and '..' are path steps.
        if job_id is not None and set(job_id) == {"."} and len(job_id) <= 2:
            raise ValueError("'.' and '..' cannot be named in a URL path")
        return job_id

    @model_validator(mode="after")
    def _sessions_set_their_own(self) -> JobRequest:
        # A sessions job runs nothing itself: each session has its own sampling and
        # limits (POST /v1/sessions), so these would be silently ignored here.
        # (Compared with the defaults, not `model_fields_set`: a stored request, read
        # back after a restart, names every field.)
        given = [name for name in ("sampling", "limits", "min_policy_version",
                                   "max_policy_version", "trainer_run", "priority",
                                   "chat_format")
                 if getattr(self, name) != type(self).model_fields[name].get_default(
                     call_default_factory=True)]
        if isinstance(self.tasks, SessionTasks) and given:
            raise ValueError(f"a sessions job takes no {', '.join(sorted(given))}: set "
                             "them on each session")
        return self

    @model_validator(mode="after")
    def _continuous(self) -> JobRequest:
        if refused := continuous_refusals(self.continuous, isinstance(
                self.tasks, SessionTasks), self.max_policy_version is not None):
            raise ValueError("; ".join(refused))
        return self

    @model_validator(mode="after")
    def _window(self) -> JobRequest:
        if self.max_policy_version is not None and \
                self.max_policy_version < self.min_policy_version:
            raise ValueError("max_policy_version is below min_policy_version")
        return self

    @model_validator(mode="after")
    def _harness_runs_suite_tasks(self) -> JobRequest:
        if self.harness is not None and not isinstance(self.tasks, SuiteTasks):
            raise ValueError("a harness runs suite tasks: give tasks.suite")
        return self

    @model_validator(mode="after")
    def _rubric_scores_suite_tasks(self) -> JobRequest:
        if self.rubric is not None and isinstance(self.tasks, ReplayTasks):
            raise ValueError("a rubric scores suite tasks (run by treadle's agent loop or a "
                             "harness) and sessions, not replayed workloads")
        return self

    @model_validator(mode="after")
    def _replay_is_one_per_line(self) -> JobRequest:
        if isinstance(self.tasks, ReplayTasks) and self.samples_per_task != 1:
            raise ValueError("replay tasks are trajectories already: samples_per_task must "
                             "be 1 (a workload's group_size sets its groups)")
        return self


class SessionLimitParams(_Strict):
    max_turns: int = Field(default=64, ge=1, le=10_000)
    max_total_tokens: int | None = Field(
        default=None, ge=2, le=1 << 20,
        description="a segment's context at most (prompt, replies, new messages); at most "
                    "the engines' context, which it is by default (4096 where they do not "
                    "say)")
    max_tokens_per_turn: int = Field(default=1024, ge=1, le=1 << 20)
    idle_timeout_s: float = Field(default=600.0, gt=0.0, le=7 * 86400.0,
                                  description="no call this long (seconds): the session "
                                              "ends with status timeout")


class SessionRequest(_Strict):
    """`POST /v1/sessions`: a session for a harness to call through its `base_url`."""

    job_id: str | None = Field(default=None, min_length=1, max_length=128,
                               description="a sessions job to join (else a job of its own)")
    group_id: str | None = Field(default=None, min_length=1, max_length=256,
                                 description="the job's group to take a session of")
    repetition: int | None = Field(default=None, ge=0, le=1 << 20,
                                   description="that group's member (needs group_id)")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: SessionLimitParams = Field(default_factory=SessionLimitParams)
    metadata: dict[str, Any] = Field(default_factory=dict, description="kept in the record")
    parent_session_id: str | None = Field(default=None, min_length=1, max_length=64,
                                          description="an open session this one is a "
                                                      "sub-agent of")
    trainable: bool = Field(default=True, description="false: a frozen sub-agent, every "
                                                      "token recorded at loss mask 0")
    chat_format: str | None = Field(default=None, min_length=1, max_length=64,
                                    description="the model family's chat format (default: "
                                                "the service's)")
    kv_across_updates: KVChoice = "recompute"
    engine_pool: Literal["policy", "frozen"] | None = Field(
        default=None, description="the engines that serve its calls: the policy's (weight "
                                  "updates reach them), or the frozen pool (a pinned "
                                  "version, `--frozen-engine`); default: frozen for a "
                                  "session that is not trainable when the service has a "
                                  "frozen pool, else the policy's")

    @model_validator(mode="after")
    def _slot(self) -> SessionRequest:
        if self.repetition is not None and self.group_id is None:
            raise ValueError("repetition needs group_id")
        if self.group_id is not None and self.job_id is None:
            raise ValueError("group_id names a group of a sessions job: it needs job_id")
        if self.parent_session_id is not None and (self.job_id or self.group_id):
            raise ValueError("a sub-agent joins its parent's job: no job_id or group_id")
        if self.engine_pool == "frozen" and self.trainable:
            # Tokens sampled by another policy are off-policy for the trainer.
            raise ValueError("engine_pool frozen serves sessions that are not trainable "
                             "(trainable: false)")
        return self


class SessionCreated(BaseModel):
    session_id: str
    base_url: str  # the harness's OpenAI base URL
    job_id: str  # whose stream delivers its trajectory
    trajectory_id: str
    max_total_tokens: int  # its context's limit: as asked, else the engines' context
    tokenizer_fingerprint: str | None = None  # the served model's tokenizer's


class SessionOpened(SessionCreated):
    """`POST /v1/sessions`'s answer: the session and its key."""

    api_key: str = Field(description="the session's key: the harness's OpenAI API key. It "
                                     "opens this session's OpenAI routes only, until the "
                                     "session ends (docs/security.md)")


class SessionEndRequest(_Strict):
    """`POST /v1/sessions/{id}/end`."""

    reward: float | None = Field(default=None, allow_inf_nan=False)
    rewards: dict[str, float] = Field(default_factory=dict,
                                      description="reward parts, kept as the record's metrics")
    status: Literal["completed", "truncated", "max_turns", "timeout", "aborted",
                    "error"] = Field(default="completed",
                                     description="error: the harness failed (an "
                                                 "infrastructure failure, stage harness)")
    reason: str | None = Field(default=None, max_length=2000)
    metadata: dict[str, Any] = Field(default_factory=dict)


class SessionView(BaseModel):
    """A session, open or just ended."""

    session_id: str
    job_id: str
    trajectory_id: str
    status: str  # running, or the trajectory's terminal status
    turns: int  # replies so far
    segments: int  # token segments so far
    reward: float | None
    children: list[str]  # sub-agent sessions' trajectory ids
    engine_pool: str  # policy | frozen: the engines that serve its calls
    tokenizer_fingerprint: str | None = None  # the served model's tokenizer's


class RolloutRequest(_Strict):
    """`POST /v1/rollouts`: one trajectory of one suite task, answered when it ends."""

    suite: str = Field(min_length=1, max_length=64)
    task: dict[str, Any] = Field(description="one task record in the suite's format")
    options: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    limits: LimitParams = Field(default_factory=LimitParams)


class JobCreated(BaseModel):
    job_id: str
    planned: int  # trajectories in the job


class JobView(JobSummary):
    """`GET /v1/jobs/{id}`: the job's summary, and what it is for."""

    # The weights the job is for (JobRequest's min/max_policy_version, trainer_run).
    min_policy_version: int = 0
    max_policy_version: int | None = None
    trainer_run: str | None = None
    # The served model's tokenizer (`agent.fingerprint`): a trainer that tokenizes on
    # its own side compares its tokenizer's with it (None: the service has none).
    tokenizer_fingerprint: str | None = None
    # What its trainer reported (POST /v1/jobs/{id}/metrics), latest value per name:
    # e.g. logprob_gap_max, the largest |trainer − engine| logprob on its tokens.
    trainer_metrics: dict[str, float] = Field(default_factory=dict)
    groups_taken: int | None = None  # a continuous job's groups handed out (else None)


class TrainerMetrics(_Strict):
    """`POST /v1/jobs/{id}/metrics`: numbers a trainer measured on the job's data
    (e.g. the logprob gap between its recomputed logprobs and the engines')."""

    metrics: dict[Annotated[str, StringConstraints(min_length=1, max_length=128)],
                  Annotated[float, Field(allow_inf_nan=False)]] = Field(max_length=64)


class EngineRequest(_Strict):
    """`POST /v1/engines`: an engine already running somewhere."""

    url: str = Field(min_length=1, max_length=2048, pattern=r"^https?://")
    kind: Literal["vllm", "sglang", "emulated"] = "vllm"
    model: str = Field(default="model", min_length=1, max_length=256,
                       description="the served model name")
    tp: int = Field(default=1, ge=1, le=64)
    max_batch: int = Field(default=256, ge=1, le=65_536)
    kv_capacity_tokens: int = Field(default=1 << 20, ge=1, le=1 << 40)
    pool: Literal["policy", "frozen"] = Field(
        default="policy", description="policy: the engines weight updates reach; frozen: "
                                      "engines at a pinned version, for frozen sub-agents")
    api: Literal["completions", "tokens"] = Field(
        default="completions",
        description="vllm only: tokens calls vLLM's /inference/v1/generate (a server "
                    "started with --enable-scale-out), whose replies say which weights "
                    "sampled each token, so keep updates freeze its calls in flight")

    @field_validator("url")
    @classmethod
    def _parses(cls, url: str) -> str:
        # What the engine client will parse; a URL it cannot is a field error, not a crash.
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as e:
            raise ValueError(f"not a valid URL: {e}") from None
        if not parsed.host:
            raise ValueError("the URL has no host")
        if not url.isascii():
            raise ValueError("not an ASCII URL: write an internationalised host in its "
                             "IDNA form (xn--...) and percent-encode the path")
        return url


class FieldError(BaseModel):
    """One bad field of a 422."""

    loc: list[str | int]  # where: ["body", "tasks", "count"], ["query", "after"]
    msg: str
    type: str


class ErrorReply(BaseModel):
    """Every error answer: a message, or (422) one entry per bad field."""

    detail: str | list[FieldError]

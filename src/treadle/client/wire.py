"""What the HTTP clients send and read, without I/O: shared by `RolloutClient` (sync)
and `AsyncRolloutClient` (async), which only carry the calls out.

Requests are plain JSON objects shaped like the service's `JobRequest` (see
`treadle.service.schemas`; the service validates them and answers a 422 naming each
bad field). `suite_tasks`, `replay_tasks` and `submit_body` build them, leaving out
the fields the caller did not set, so that the service's defaults apply. Each route
is a `Call`: method, path, body and how to read a 2xx answer.

Answers are read into frozen dataclasses (`JobState`, `EngineState`, `WeightsState`,
`Health`); fields the service adds later are ignored, a field it lacks is a
`ServiceProtocolError`. Finished trajectories come as `Delivered`: the sequence
number of the job's NDJSON stream and the decoded `Trajectory`. Resuming streams
and retrying calls is `treadle.client.stream`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from treadle.client.errors import ServiceError, ServiceProtocolError
from treadle.store.errors import RecordError
from treadle.store.jobs import JobStatus
from treadle.store.record import trajectory_from_record
from treadle.types import Trajectory

_T = TypeVar("_T")
_V = TypeVar("_V")
_TERMINAL = frozenset(s.value for s in JobStatus if s.terminal)  # as the wire spells them

# -- answers ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivered:
    """One finished trajectory of a job, as the stream handed it out."""

    seq: int  # its delivery number: 1-based, dense, in completion order
    trajectory: Trajectory  # decoded from the record (treadle.store.record)


@dataclass(frozen=True, slots=True)
class SubmittedJob:
    """What `submit` got back, and what the client knows from the request."""

    job_id: str  # the caller's id, or the one the service chose
    planned: int  # trajectories in the job
    group_size: int | dict[str, int]  # members per GRPO group (see group_sizes)
    continuous: bool = False  # a continuous job: its groups are taken (`take`)


@dataclass(frozen=True, slots=True)
class JobState:
    """`GET /v1/jobs/{id}`."""

    job_id: str
    status: str  # queued | running | completed | cancelled | failed
    reason: str | None  # why it was cancelled or failed, or how many infrastructure failures
    planned: int  # trajectories in the job
    delivered: int  # finished so far; the stream's last sequence number
    counts: dict[str, int]  # trajectories per status
    progress: float  # delivered / planned
    created_at: float  # the service's clock
    started_at: float | None
    finished_at: float | None
    running: int  # in flight in the service process now
    queued: int  # waiting for a slot in the service process now
    min_policy_version: int = 0  # the weights the job is for (its request's window)
    max_policy_version: int | None = None
    trainer_run: str | None = None
    trainer_metrics: dict[str, float] = field(default_factory=dict)  # its trainer's reports
    tokenizer_fingerprint: str | None = None  # the served model's tokenizer's
    groups_taken: int | None = None  # a continuous job's groups handed out (else None)

    @property
    def terminal(self) -> bool:
        """Completed, cancelled or failed: nothing more will be delivered after `delivered`."""
        return self.status in _TERMINAL

    @property
    def infrastructure_failures(self) -> int:
        """Trajectories ended by an infrastructure failure (status error)."""
        return self.counts.get("error", 0)


@dataclass(frozen=True, slots=True)
class EngineState:
    """One engine of the pool (`GET /v1/engines`)."""

    engine_id: str
    label: str  # its URL, for registered engines
    tp: int  # tensor-parallel degree
    max_batch: int
    kv_capacity_tokens: int
    calls_in_flight: int
    draining: bool  # gets nothing more; removed once idle


@dataclass(frozen=True, slots=True)
class WeightsState:
    """`GET /v1/weights` and the weight routes' answers."""

    policy_version: int  # stamped on tokens sampled from now on
    paused: bool  # new engine calls are held
    trainer_run: str | None = None  # whose weights the engines serve (None: unnamed)
    frozen_policy_version: int | None = None  # the frozen pool's pinned version, if any


@dataclass(frozen=True, slots=True)
class Health:
    """`GET /healthz` (no auth)."""

    status: str  # "ok"
    engines: int  # engines in the pool
    policy_version: int
    tokenizer_fingerprint: str | None = None  # the served model's tokenizer's


def read_view(cls: type[_V], value: Any, what: str) -> _V:
    """`cls` (a dataclass) from a JSON object; extra keys are ignored."""
    if not isinstance(value, dict):
        raise ServiceProtocolError(f"{what}: expected a JSON object, got {type(value).__name__}")
    declared = fields(cls)  # type: ignore[arg-type]
    # Fields with defaults are newer than the oldest service this client reads.
    missing = [f.name for f in declared if f.name not in value
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ServiceProtocolError(f"{what}: the answer lacks {', '.join(missing)}")
    return cls(**{f.name: value[f.name] for f in declared if f.name in value})


def json_of(response: httpx.Response, what: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise ServiceProtocolError(f"{what}: the answer is not JSON: "
                                   f"{response.text[:200]!r}") from None


def service_error(response: httpx.Response, method: str, path: str) -> ServiceError:
    """The ServiceError of an error answer (its JSON `detail`, else its text)."""
    try:
        body = response.json()
        detail = body.get("detail", body) if isinstance(body, dict) else body
    except ValueError:
        detail = response.text[:500]
    return ServiceError(method, path, response.status_code, detail)


# -- requests ---------------------------------------------------------------------------


def given(**values: Any) -> dict[str, Any]:
    """The values that are not None (left out, the service's defaults apply)."""
    return {k: v for k, v in values.items() if v is not None}


def submit_body(request: Mapping[str, Any] | None, fields: Mapping[str, Any]) -> dict[str, Any]:
    """`request` (a JobRequest-shaped dict) with the keyword `fields` that are set
    laid over it; ValueError without tasks."""
    body = {**(request or {}), **given(**fields)}
    if "tasks" not in body:
        raise ValueError("a job needs 'tasks' (suite_tasks(...) or replay_tasks(...))")
    return body


def suite_tasks(suite: str, *, count: int | None = None, seed: int | None = None,
                tasks: list[dict[str, Any]] | None = None,
                options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tasks of a suite: `count` generated with `seed`, or `tasks` (the suite's JSONL
    records, docs/suites.md); `options` go to the suite's constructor."""
    return given(suite=suite, count=count, seed=seed, tasks=tasks, options=options)


def replay_tasks(workload: str | None = None, *, trajectories: int | None = None,
                 seed: int | None = None, group_size: int | None = None,
                 trace: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Workload trajectories replayed on the engines: a generated `workload` (coding,
    search, math, swe, or a shape: pareto, bimodal, flat, short) of `trajectories` in
    groups of `group_size`, or `trace` lines (the format of `treadle sim`'s traces)."""
    return given(workload=workload, trajectories=trajectories, seed=seed,
                 group_size=group_size, trace=trace)


def group_sizes(request: Mapping[str, Any], job_id: str) -> int | dict[str, int]:
    """Members per group of the job `request` describes, with the service's defaults
    (`samples_per_task` 1, a workload's `group_size` 16): one size for every group, or
    per group id (``{job_id}/{group}``) for a trace."""
    tasks = request.get("tasks")
    if not isinstance(tasks, Mapping):
        raise ValueError("the request has no 'tasks' object")
    if "suite" in tasks:
        return int(request.get("samples_per_task", 1))
    trace = tasks.get("trace")
    if trace is not None:
        sizes: dict[str, int] = {}
        for line in trace:
            group = f"{job_id}/{line['group']}"
            sizes[group] = sizes.get(group, 0) + 1
        return sizes
    return int(tasks.get("group_size", 16))


# -- calls ------------------------------------------------------------------------------


class _Unset:
    """The client's default timeout (a call may set its own, or None: no limit)."""


UNSET = _Unset()


@dataclass(frozen=True, slots=True)
class Call(Generic[_T]):
    """One route call: what to send and how to read the answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], _T]  # a 2xx answer to the result
    body: Any = None  # JSON body, None for none
    timeout_s: float | _Unset | None = UNSET  # read timeout; None waits as long as it takes
    idempotent: bool = False  # safe to send again after a lost answer (as a GET is)

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


def call_timeout(call: Call[Any], default_s: float) -> httpx.Timeout:
    """The call's timeouts: `default_s`, the read timeout the call's own if it has one."""
    read = default_s if isinstance(call.timeout_s, _Unset) else call.timeout_s
    return httpx.Timeout(default_s, read=read)


def _one(cls: type[_V], what: str) -> Callable[[httpx.Response], _V]:
    return lambda r: read_view(cls, json_of(r, what), what)


def _seg(value: str) -> str:
    return quote(value, safe="")


def submit_call(request: Mapping[str, Any] | None,
                fields: Mapping[str, Any]) -> Call[SubmittedJob]:
    body = submit_body(request, fields)

    def parse(r: httpx.Response) -> SubmittedJob:
        value = json_of(r, "POST /v1/jobs")
        if not isinstance(value, dict) or not isinstance(value.get("job_id"), str) \
                or not isinstance(value.get("planned"), int):
            raise ServiceProtocolError(f"POST /v1/jobs: unexpected answer {value!r:.200}")
        return SubmittedJob(value["job_id"], value["planned"],
                            group_sizes(body, value["job_id"]),
                            continuous=body.get("continuous") is not None)
    return Call("POST", "/v1/jobs", parse, body)


def job_call(job_id: str) -> Call[JobState]:
    path = f"/v1/jobs/{_seg(job_id)}"
    return Call("GET", path, _one(JobState, f"GET {path}"))


def cancel_call(job_id: str) -> Call[JobState]:
    path = f"/v1/jobs/{_seg(job_id)}/cancel"
    return Call("POST", path, _one(JobState, f"POST {path}"))


def rollout_call(suite: str, task: Mapping[str, Any], options: Mapping[str, Any] | None,
                 sampling: Mapping[str, float] | None, limits: Mapping[str, Any] | None,
                 timeout_s: float | None) -> Call[Trajectory]:
    body = given(suite=suite, task=dict(task), options=options, sampling=sampling,
                 limits=limits)

    def parse(r: httpx.Response) -> Trajectory:
        return decode_trajectory(json_of(r, "POST /v1/rollouts"), "POST /v1/rollouts")
    return Call("POST", "/v1/rollouts", parse, body, timeout_s)


def engines_call() -> Call[list[EngineState]]:
    def parse(r: httpx.Response) -> list[EngineState]:
        value = json_of(r, "GET /v1/engines")
        if not isinstance(value, list):
            raise ServiceProtocolError("GET /v1/engines: expected a JSON array")
        return [read_view(EngineState, v, "GET /v1/engines") for v in value]
    return Call("GET", "/v1/engines", parse)


def register_engine_call(url: str, kind: str | None, model: str | None, tp: int | None,
                         max_batch: int | None,
                         kv_capacity_tokens: int | None) -> Call[EngineState]:
    body = given(url=url, kind=kind, model=model, tp=tp, max_batch=max_batch,
                 kv_capacity_tokens=kv_capacity_tokens)
    return Call("POST", "/v1/engines", _one(EngineState, "POST /v1/engines"), body)


def drain_engine_call(engine_id: str) -> Call[EngineState]:
    path = f"/v1/engines/{_seg(engine_id)}/drain"
    return Call("POST", path, _one(EngineState, f"POST {path}"))


def remove_engine_call(engine_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/engines/{_seg(engine_id)}", lambda r: None)


def weights_call() -> Call[WeightsState]:
    return Call("GET", "/v1/weights", _one(WeightsState, "GET /v1/weights"))


def pause_call(mode: str, timeout_s: float | None) -> Call[WeightsState]:
    return _weights("pause", {"mode": mode}, timeout_s)


def resume_call(policy_version: int, trainer_run: str | None = None) -> Call[WeightsState]:
    return _weights("resume", given(policy_version=policy_version, trainer_run=trainer_run))


UPDATE_ANSWER_GRACE_S = 30.0  # past an update's own timeout, for its 504 to arrive


def update_weights_call(weights_path: str, policy_version: int, mode: str,
                        timeout_s: float | None,
                        trainer_run: str | None = None) -> Call[WeightsState]:
    """The service bounds the update by `timeout_s` (its own default if None); the
    call waits a grace longer, so that the service's answer, not a read timeout, says
    what happened."""
    return _weights("update", given(weights_path=weights_path, policy_version=policy_version,
                                    mode=mode, trainer_run=trainer_run, timeout_s=timeout_s),
                    None if timeout_s is None else timeout_s + UPDATE_ANSWER_GRACE_S)


def report_call(job_id: str, metrics: Mapping[str, float]) -> Call[JobState]:
    path = f"/v1/jobs/{_seg(job_id)}/metrics"
    return Call("POST", path, _one(JobState, f"POST {path}"), {"metrics": dict(metrics)})


def _weights(route: str, body: dict[str, Any],
             timeout_s: float | _Unset | None = UNSET) -> Call[WeightsState]:
    path = f"/v1/weights/{route}"
    return Call("POST", path, _one(WeightsState, f"POST {path}"), body, timeout_s)


def health_call() -> Call[Health]:
    return Call("GET", "/healthz", _one(Health, "GET /healthz"))


def metrics_call() -> Call[str]:
    return Call("GET", "/metrics", lambda r: r.text)


def stream_path(job_id: str) -> str:
    return f"/v1/jobs/{_seg(job_id)}/trajectories"


def auth_headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


GroupSizes = int | Mapping[str, int]  # one size for all groups, or per group id


def group_args(job: str | SubmittedJob,
               group_size: GroupSizes | None) -> tuple[str, GroupSizes]:
    """(job id, group sizes) for `groups()`: a SubmittedJob knows its sizes."""
    if isinstance(job, SubmittedJob):
        return job.job_id, job.group_size if group_size is None else group_size
    if group_size is None:
        raise ValueError("groups() of a job id needs group_size (members per group)")
    return job, group_size


def decode_trajectory(value: Any, where: str) -> Trajectory:
    try:
        return trajectory_from_record(value)
    except RecordError as e:
        raise ServiceProtocolError(f"{where}: malformed trajectory record: {e}") from e


__all__ = [
    "Call",
    "Delivered",
    "EngineState",
    "Health",
    "JobState",
    "SubmittedJob",
    "WeightsState",
    "group_sizes",
    "replay_tasks",
    "submit_body",
    "suite_tasks",
]

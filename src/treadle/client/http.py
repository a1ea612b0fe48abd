"""The trainer's HTTP client of the rollout service (synchronous, `httpx.Client`).

    with RolloutClient("http://rollouts:8700", token=TOKEN) as client:
        job = client.submit(tasks=suite_tasks("math", count=64), samples_per_task=8)
        for group in client.groups(job):           # each GRPO group once it is whole
            batch = group.batch()                  # infrastructure failures dropped
            ...

`token` is the key the client speaks with: the service token (the admin's) or a
trainer key, which sees its own run's jobs only (another run's job is a
ServiceError 404) and pushes its own run's weights only (docs/security.md).

One method per route of `treadle.service.app` (its docstring lists them); answers
are the dataclasses of `treadle.client.wire`, error answers `ServiceError` (status
and detail), and a service that cannot be reached `ServiceUnavailable` after the
`RetryPolicy`'s tries. `AsyncRolloutClient` (treadle.client.aio) has the same
methods, awaitable.

Retries: a call is tried again after a failure to connect (nothing was sent) and
after the service's 503 "busy" (sent before it reads the request), for every
method; a GET also after a dropped connection or a proxy's 502/504. A POST whose
connection failed after it was sent is not repeated (it may have been carried
out): ServiceUnavailable says so; give `job_id` to make resubmitting a job safe
(a second submission is a 409).

Streams: `trajectories` follows a job's NDJSON stream and, when the connection
drops or the service restarts, reconnects from its cursor (``?after=`` the last
sequence number it handed out) with backoff: nothing is delivered twice, nothing is
skipped, and `RetryPolicy.attempts` failures in a row without a new trajectory end
it with ServiceUnavailable. A stream that ends cleanly before its job has ended
counts as a failure too. While no trajectory finishes the service writes a blank
line every 15 s (`ServiceConfig.stream_heartbeat_s`); a stream silent for
`stream_idle_s` (default 60 s) is taken for a dead connection — a proxy that
stopped forwarding, a half-open socket — and reconnects (None: never; a
reconnection after silence is not a failure).

Timeouts: `timeout_s` bounds each call; `rollout` and `pause` wait as long as they
take unless given their own `timeout_s`; `update_weights` passes its `timeout_s` to
the service, which bounds the update by it (600 s if not given).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx

from treadle.client import stream, wire
from treadle.client.groups import Group, GroupCollector, GroupSizes
from treadle.client.stream import RestartWatch, Retries, RetryPolicy, StreamCursor
from treadle.client.take import TakeProgress
from treadle.client.wire import (
    Call,
    Delivered,
    EngineState,
    Health,
    JobState,
    SubmittedJob,
    WeightsState,
)
from treadle.types import Trajectory

_T = TypeVar("_T")


class RolloutClient:
    """A synchronous client of one rollout service; see the module docstring."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0,
                 retry: RetryPolicy | None = None, stream_idle_s: float | None = 60.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s  # per call, unless the call sets its own
        self.retry = retry or RetryPolicy()
        self.stream_idle_s = stream_idle_s  # silence before a stream reconnects
        self._restart = RestartWatch()  # how long the service says its restarts take
        self._http = httpx.Client(base_url=self.url, headers=wire.auth_headers(token),
                                  timeout=timeout_s, transport=transport,
                                  event_hooks={"response": [self._restart.note]})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- jobs ---------------------------------------------------------------------------

    def submit(self, request: Mapping[str, Any] | None = None, *,
               tasks: Mapping[str, Any] | None = None, samples_per_task: int | None = None,
               sampling: Mapping[str, float] | None = None,
               limits: Mapping[str, Any] | None = None, min_policy_version: int | None = None,
               max_policy_version: int | None = None, trainer_run: str | None = None,
               priority: int | None = None, job_id: str | None = None) -> SubmittedJob:
        """Submit a job: `request` (a JobRequest-shaped dict) and/or the keywords, which
        win. `tasks` from `suite_tasks` or `replay_tasks`; `samples_per_task` is the
        GRPO group size of suite tasks; `sampling` {temperature, top_p, seed}; `limits`
        {max_turns, max_total_tokens, max_tokens_per_turn, deadline_s}; trajectories
        start once the engines serve `min_policy_version`, and the job is refused
        (ServiceError 409) when they serve a version past `max_policy_version` or
        weights of a run other than `trainer_run` (min = max: exactly one version);
        higher `priority` first. ServiceError 422 names each bad field, 409 a `job_id`
        already taken."""
        return self._do(wire.submit_call(request, dict(
            tasks=tasks, samples_per_task=samples_per_task, sampling=sampling,
            limits=limits, min_policy_version=min_policy_version,
            max_policy_version=max_policy_version, trainer_run=trainer_run, priority=priority,
            job_id=job_id)))

    def job(self, job_id: str) -> JobState:
        """The job's status, counts by trajectory status and progress."""
        return self._do(wire.job_call(job_id))

    def cancel(self, job_id: str) -> JobState:
        """Cancel the job: its unfinished trajectories are delivered as aborted."""
        return self._do(wire.cancel_call(job_id))

    def report(self, job_id: str, metrics: Mapping[str, float]) -> JobState:
        """Keep numbers the trainer measured on the job's data (e.g. the logprob gap
        `logprob_gap_max`) in the job's view (`JobState.trainer_metrics`)."""
        return self._do(wire.report_call(job_id, metrics))

    def rollout(self, suite: str, task: Mapping[str, Any], *,
                options: Mapping[str, Any] | None = None,
                sampling: Mapping[str, float] | None = None,
                limits: Mapping[str, Any] | None = None,
                timeout_s: float | None = None) -> Trajectory:
        """One trajectory of one task record of `suite`, answered when it ends."""
        return self._do(wire.rollout_call(suite, task, options, sampling, limits,
                                          timeout_s))

    # -- results ------------------------------------------------------------------------

    def trajectories(self, job_id: str, *, after: int = 0,
                     follow: bool = True) -> Iterator[Delivered]:
        """The job's finished trajectories with seq > `after`, in completion order,
        each once; with `follow` until the job ends, resuming across dropped
        connections and restarts (see the module docstring)."""
        path = wire.stream_path(job_id)
        cursor = StreamCursor(job_id, after)
        retries = Retries(self.retry, f"GET {path}", self._restart)
        while True:
            cursor.reconnect()
            failure: BaseException | None = None
            wait_hint: float | None = None
            answered = False
            try:
                with self._http.stream("GET", path, params=stream.stream_params(cursor, follow),
                                       timeout=httpx.Timeout(self.timeout_s,
                                                             read=self.stream_idle_s)) as r:
                    if r.status_code != 200:
                        r.read()
                        failure, wait_hint = stream.refused(r, path), stream.retry_after(r)
                    else:
                        answered = True
                        for chunk in r.iter_bytes():
                            for delivered in cursor.feed(chunk):
                                retries.progress()
                                yield delivered
            except httpx.ReadTimeout as e:
                if not answered:
                    failure = e
                else:
                    continue  # silence on an open stream: reconnect, no failure
            except httpx.TransportError as e:
                failure = e
            if failure is None:  # a clean end: over, unless cut short or the job goes on
                if cursor.cut:
                    failure = stream.cut_line(cursor)
                elif not follow:
                    return
                else:
                    failure = stream.ended_early(cursor, self.job(job_id))
                    if failure is None:
                        return
            time.sleep(retries.failed(failure, wait_hint))

    def groups(self, job: str | SubmittedJob, group_size: GroupSizes | None = None, *,
               follow: bool = True) -> Iterator[Group]:
        """The job's GRPO groups, each as soon as its last member is delivered; at
        the end, groups still short (``complete=False``). The sizes come from a
        `SubmittedJob`, or from `group_size` (one size, or per group id). A
        continuous job's `SubmittedJob`: its groups taken one at a time (`take`),
        until the job ends."""
        if isinstance(job, SubmittedJob) and job.continuous:
            while taken := self.take(job.job_id, 1):  # [] once the job has ended
                yield taken[0]
            return
        job_id, sizes = wire.group_args(job, group_size)
        collector = GroupCollector(sizes)
        for delivered in self.trajectories(job_id, follow=follow):
            group = collector.add(delivered)
            if group is not None:
                yield group
        yield from collector.rest()

    def take(self, job_id: str, n: int = 1, *, timeout_s: float | None = None) -> list[Group]:
        """The next `n` complete groups of a continuous job, each handed out once
        (to this client or any other), waiting until they are there — fewer only
        once the job has ended (or `timeout_s` has passed). Its calls are tried
        again across dropped connections and service restarts, with the client's
        patience (`RetryPolicy`): a group is never lost or handed out twice
        (`treadle.client.take`)."""
        progress = TakeProgress(n, timeout_s)
        while (call := progress.next_call(job_id)) is not None:
            progress.got(self._do(call))
        return progress.groups

    # -- engines and weights ---------------------------------------------------------------

    def engines(self) -> list[EngineState]:
        return self._do(wire.engines_call())

    def register_engine(self, url: str, *, kind: str | None = None, model: str | None = None,
                        tp: int | None = None, max_batch: int | None = None,
                        kv_capacity_tokens: int | None = None) -> EngineState:
        """Add a running engine (vllm, sglang or emulated) to the pool; the service
        checks its health first (422 if it is not healthy)."""
        return self._do(wire.register_engine_call(url, kind, model, tp, max_batch,
                                                  kv_capacity_tokens))

    def drain_engine(self, engine_id: str) -> EngineState:
        """Send the engine nothing more; it leaves the pool once idle."""
        return self._do(wire.drain_engine_call(engine_id))

    def remove_engine(self, engine_id: str) -> None:
        """Remove the engine now; its turns move to the others."""
        self._do(wire.remove_engine_call(engine_id))

    def weights(self) -> WeightsState:
        return self._do(wire.weights_call())

    def pause(self, mode: str = "drain", *, timeout_s: float | None = None) -> WeightsState:
        """Hold new engine calls; "drain" those in flight (wait for them), or "abort"
        them (their turns resume afterwards). Returns once none is in flight."""
        return self._do(wire.pause_call(mode, timeout_s))

    def resume(self, policy_version: int, *, trainer_run: str | None = None) -> WeightsState:
        """The engines serve `policy_version` (of `trainer_run`) now: new tokens carry it."""
        return self._do(wire.resume_call(policy_version, trainer_run))

    def update_weights(self, weights_path: str, policy_version: int, *, mode: str = "drain",
                       timeout_s: float | None = None,
                       trainer_run: str | None = None) -> WeightsState:
        """The whole barrier: pause, every engine loads `weights_path`, resume. `mode`:
        what happens to engine calls in flight — "abort", "drain" (wait for them) or
        "keep" (frozen in engines that can keep them and continued under the new
        weights; docs/async.md). The service fails the update past `timeout_s` (its
        default: 600 s), leaving the old weights serving (ServiceError 504). Name the
        `trainer_run`, so that jobs of another run are refused rather than trained on
        these weights."""
        return self._do(wire.update_weights_call(weights_path, policy_version, mode, timeout_s,
                                                 trainer_run))

    # -- the service ----------------------------------------------------------------------

    def health(self) -> Health:
        return self._do(wire.health_call())

    def metrics(self) -> str:
        """The Prometheus text of `GET /metrics`."""
        return self._do(wire.metrics_call())

    def _do(self, call: Call[_T]) -> _T:
        retries = Retries(self.retry, call.what, self._restart)
        while True:
            try:
                r = self._http.request(call.method, call.path, json=call.body,
                                       timeout=wire.call_timeout(call, self.timeout_s))
            except httpx.TransportError as e:
                if not stream.retriable(e, _as(call)):
                    raise stream.sent_and_lost(call, e) from e
                time.sleep(retries.failed(e))
                continue
            if r.is_success:
                return call.parse(r)
            error = wire.service_error(r, call.method, call.path)
            if not stream.retriable_status(r.status_code, _as(call)):
                raise error
            time.sleep(retries.failed(error, stream.retry_after(r)))


def _as(call: Call[Any]) -> str:
    """The method a call is retried as: an idempotent POST as a GET."""
    return "GET" if call.idempotent else call.method


__all__ = ["RolloutClient"]

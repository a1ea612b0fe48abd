"""The trainer's HTTP client of the rollout service, for asyncio (`httpx.AsyncClient`).

    async with AsyncRolloutClient("http://rollouts:8700", token=TOKEN) as client:
        job = await client.submit(tasks=suite_tasks("math", count=64), samples_per_task=8)
        async for group in client.groups(job):
            ...

The same methods as `treadle.client.http.RolloutClient`, with the same retries,
resumption and errors (its docstring says how they behave), awaitable; the streams
are async iterators. A stream's wait between reconnections is an `asyncio.sleep`,
so cancelling the task that iterates stops it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
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


class AsyncRolloutClient:
    """An asyncio client of one rollout service; see `RolloutClient` for each method."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 30.0,
                 retry: RetryPolicy | None = None, stream_idle_s: float | None = 60.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s  # per call, unless the call sets its own
        self.retry = retry or RetryPolicy()
        self.stream_idle_s = stream_idle_s  # silence before a stream reconnects
        self._restart = RestartWatch()  # how long the service says its restarts take
        self._http = httpx.AsyncClient(base_url=self.url, headers=wire.auth_headers(token),
                                       timeout=timeout_s, transport=transport,
                                       event_hooks={"response": [self._note_restart]})

    async def _note_restart(self, response: httpx.Response) -> None:
        self._restart.note(response)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # -- jobs ---------------------------------------------------------------------------

    async def submit(self, request: Mapping[str, Any] | None = None, *,
                     tasks: Mapping[str, Any] | None = None,
                     samples_per_task: int | None = None,
                     sampling: Mapping[str, float] | None = None,
                     limits: Mapping[str, Any] | None = None,
                     min_policy_version: int | None = None,
                     max_policy_version: int | None = None, trainer_run: str | None = None,
                     priority: int | None = None, job_id: str | None = None) -> SubmittedJob:
        return await self._do(wire.submit_call(request, dict(
            tasks=tasks, samples_per_task=samples_per_task, sampling=sampling,
            limits=limits, min_policy_version=min_policy_version,
            max_policy_version=max_policy_version, trainer_run=trainer_run, priority=priority,
            job_id=job_id)))

    async def job(self, job_id: str) -> JobState:
        return await self._do(wire.job_call(job_id))

    async def cancel(self, job_id: str) -> JobState:
        return await self._do(wire.cancel_call(job_id))

    async def report(self, job_id: str, metrics: Mapping[str, float]) -> JobState:
        return await self._do(wire.report_call(job_id, metrics))

    async def rollout(self, suite: str, task: Mapping[str, Any], *,
                      options: Mapping[str, Any] | None = None,
                      sampling: Mapping[str, float] | None = None,
                      limits: Mapping[str, Any] | None = None,
                      timeout_s: float | None = None) -> Trajectory:
        return await self._do(wire.rollout_call(suite, task, options, sampling, limits,
                                                timeout_s))

    # -- results ------------------------------------------------------------------------

    async def trajectories(self, job_id: str, *, after: int = 0,
                           follow: bool = True) -> AsyncIterator[Delivered]:
        path = wire.stream_path(job_id)
        cursor = StreamCursor(job_id, after)
        retries = Retries(self.retry, f"GET {path}", self._restart)
        while True:
            cursor.reconnect()
            failure: BaseException | None = None
            wait_hint: float | None = None
            answered = False
            try:
                async with self._http.stream(
                        "GET", path, params=stream.stream_params(cursor, follow),
                        timeout=httpx.Timeout(self.timeout_s, read=self.stream_idle_s)) as r:
                    if r.status_code != 200:
                        await r.aread()
                        failure, wait_hint = stream.refused(r, path), stream.retry_after(r)
                    else:
                        answered = True
                        async for chunk in r.aiter_bytes():
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
                    failure = stream.ended_early(cursor, await self.job(job_id))
                    if failure is None:
                        return
            await asyncio.sleep(retries.failed(failure, wait_hint))

    async def groups(self, job: str | SubmittedJob, group_size: GroupSizes | None = None, *,
                     follow: bool = True) -> AsyncIterator[Group]:
        if isinstance(job, SubmittedJob) and job.continuous:
            while taken := await self.take(job.job_id, 1):  # [] once the job has ended
                yield taken[0]
            return
        job_id, sizes = wire.group_args(job, group_size)
        collector = GroupCollector(sizes)
        async for delivered in self.trajectories(job_id, follow=follow):
            group = collector.add(delivered)
            if group is not None:
                yield group
        for group in collector.rest():
            yield group

    async def take(self, job_id: str, n: int = 1, *,
                   timeout_s: float | None = None) -> list[Group]:
        progress = TakeProgress(n, timeout_s)
        while (call := progress.next_call(job_id)) is not None:
            progress.got(await self._do(call))
        return progress.groups

    # -- engines and weights ---------------------------------------------------------------

    async def engines(self) -> list[EngineState]:
        return await self._do(wire.engines_call())

    async def register_engine(self, url: str, *, kind: str | None = None,
                              model: str | None = None, tp: int | None = None,
                              max_batch: int | None = None,
                              kv_capacity_tokens: int | None = None) -> EngineState:
        return await self._do(wire.register_engine_call(url, kind, model, tp, max_batch,
                                                        kv_capacity_tokens))

    async def drain_engine(self, engine_id: str) -> EngineState:
        return await self._do(wire.drain_engine_call(engine_id))

    async def remove_engine(self, engine_id: str) -> None:
        await self._do(wire.remove_engine_call(engine_id))

    async def weights(self) -> WeightsState:
        return await self._do(wire.weights_call())

    async def pause(self, mode: str = "drain", *, timeout_s: float | None = None) -> WeightsState:
        return await self._do(wire.pause_call(mode, timeout_s))

    async def resume(self, policy_version: int, *,
                     trainer_run: str | None = None) -> WeightsState:
        return await self._do(wire.resume_call(policy_version, trainer_run))

    async def update_weights(self, weights_path: str, policy_version: int, *,
                             mode: str = "drain", timeout_s: float | None = None,
                             trainer_run: str | None = None) -> WeightsState:
        return await self._do(wire.update_weights_call(weights_path, policy_version, mode,
                                                       timeout_s, trainer_run))

    # -- the service ----------------------------------------------------------------------

    async def health(self) -> Health:
        return await self._do(wire.health_call())

    async def metrics(self) -> str:
        return await self._do(wire.metrics_call())

    async def _do(self, call: Call[_T]) -> _T:
        retries = Retries(self.retry, call.what, self._restart)
        while True:
            try:
                r = await self._http.request(call.method, call.path, json=call.body,
                                             timeout=wire.call_timeout(call, self.timeout_s))
            except httpx.TransportError as e:
                if not stream.retriable(e, _as(call)):
                    raise stream.sent_and_lost(call, e) from e
                await asyncio.sleep(retries.failed(e))
                continue
            if r.is_success:
                return call.parse(r)
            error = wire.service_error(r, call.method, call.path)
            if not stream.retriable_status(r.status_code, _as(call)):
                raise error
            await asyncio.sleep(retries.failed(error, stream.retry_after(r)))


def _as(call: Call[Any]) -> str:
    """The method a call is retried as: an idempotent POST as a GET."""
    return "GET" if call.idempotent else call.method


__all__ = ["AsyncRolloutClient"]

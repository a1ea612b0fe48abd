"""`/v1/jobs`: submit, list, read, stream and cancel jobs; a trainer's reports on one;
what the dashboard shows of one (its timeline, GRPO groups and a trajectory's
record). A trainer key lists and reads its own run's jobs only."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, StreamingResponse

from treadle.service.continuous_schemas import (
    TakenGroupView,
    TakenMember,
    TakeReply,
    TakeRequest,
)
from treadle.service.deps import CallerDep, OwnedJobDep, ServiceDep
from treadle.service.keys import owner_of, run_named
from treadle.service.replies import documented
from treadle.service.schemas import (
    MAX_INT64,
    JobCreated,
    JobRequest,
    JobView,
    SessionTasks,
    TrainerMetrics,
)
from treadle.service.state import Service
from treadle.service.strict_json import StrictJSONRoute
from treadle.service.views import JobGroups, JobSummary, TrajectoryDetail
from treadle.store.jobs import JobInfo, JobStatus, TakenGroup
from treadle.types import TrajectoryStatus

router = APIRouter(prefix="/v1/jobs", route_class=StrictJSONRoute, tags=["jobs"])


@router.post("", status_code=201, responses=documented(409, 422))
async def submit(request: JobRequest, caller: CallerDep, service: ServiceDep) -> JobCreated:
    """A trainer key's job is its run's: only that run's keys (and the admin's) see it,
    and it runs on that run's weights only (or the engines' initial ones)."""
    if not isinstance(request.tasks, SessionTasks):  # (a sessions job has no window)
        request = request.model_copy(update={
            "trainer_run": run_named(caller, request.trainer_run)})
    jobs = service.rollouts if request.continuous is None else service.continuous
    info = await jobs.submit(request, owner=owner_of(caller))
    return JobCreated(job_id=info.job_id, planned=info.planned)


@router.get("")
async def listed(caller: CallerDep, service: ServiceDep,
                 limit: int = Query(100, ge=1, le=1000)) -> list[JobSummary]:
    """The newest `limit` jobs the caller sees (a trainer: its run's)."""
    infos = await service.store.recent_jobs(limit, owner=owner_of(caller))
    return [job_summary(info, *service.rollouts.here(info.job_id)) for info in infos]


@router.get("/{job_id}", responses=documented(404))
async def job(job_id: str, _owned: OwnedJobDep, service: ServiceDep) -> JobView:
    return await _view(job_id, service)


@router.post("/{job_id}/metrics", responses=documented(404, 422))
async def report(job_id: str, body: TrainerMetrics, _owned: OwnedJobDep,
                 service: ServiceDep) -> JobView:
    """Numbers the trainer measured on the job's data (e.g. `logprob_gap_max`),
    shown in the job's view from then on."""
    await service.rollouts.report(job_id, body.metrics)
    return await _view(job_id, service)


@router.get("/{job_id}/trajectories", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-ndjson": {}},
                             "description": "one JSON object a line"}, **documented(404, 422)})
async def trajectories(job_id: str, _owned: OwnedJobDep, service: ServiceDep,
                       after: int = Query(0, ge=0, le=MAX_INT64),
                       follow: bool = Query(False)) -> StreamingResponse:
    # OwnedJobDep: the 404 before the stream starts.

    async def lines() -> AsyncIterator[bytes]:
        async for d in service.rollouts.results(
                job_id, after, follow=follow, heartbeat_s=service.config.stream_heartbeat_s):
            # None: a heartbeat, a blank line (readers skip blank lines).
            yield b"\n" if d is None else \
                f'{{"seq":{d.seq},"trajectory":{d.record_json}}}\n'.encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/{job_id}/take", responses=documented(404, 422))
async def take(job_id: str, body: TakeRequest, _owned: OwnedJobDep,
               service: ServiceDep) -> TakeReply:
    """A continuous job's next complete GRPO groups, each handed out once: up to `n`,
    waiting up to `wait_s` for them (fewer may come: call again, with a new
    `take_id`). The same `take_id` again answers the same groups (a lost answer is
    asked for again, never lost)."""
    groups, taken, ended = await service.continuous.take(job_id, body.take_id, body.n,
                                                         body.wait_s)
    return TakeReply(groups=[_taken_view(g) for g in groups], taken=taken, ended=ended)


@router.get("/{job_id}/taken", responses=documented(404, 422))
async def taken(job_id: str, _owned: OwnedJobDep, service: ServiceDep,
                after: int = Query(0, ge=0, le=MAX_INT64),
                limit: int = Query(16, ge=1, le=256)) -> list[TakenGroupView]:
    """A continuous job's groups handed out already, with take numbers after `after`
    (read back from the store, a page at a time)."""
    return [_taken_view(g) for g in await service.store.taken_groups(job_id, after, limit)]


def _taken_view(group: TakenGroup) -> TakenGroupView:
    return TakenGroupView(taken=group.taken, group_id=group.group_id, size=group.size,
                          stale=group.stale, members=[
                              TakenMember(seq=d.seq, trajectory=d.record())
                              for d in group.members])


@router.get("/{job_id}/timeline",  # (its errors are JSON like every other route's)
            responses={200: {"content": {"text/html": {}},
                             "description": "the job's timeline page (treadle run's report)"},
                       **documented(404)})
async def timeline(job_id: str, _owned: OwnedJobDep, service: ServiceDep) -> HTMLResponse:
    """One self-contained page: a row per trajectory, running ones up to now."""
    return HTMLResponse(await service.records.timeline(job_id))


@router.get("/{job_id}/groups", responses=documented(404, 422))
async def groups(job_id: str, _owned: OwnedJobDep, service: ServiceDep,
                 limit: int = Query(200, ge=1, le=5000)) -> JobGroups:
    return await service.records.groups(job_id, limit)


@router.get("/{job_id}/record", responses=documented(404, 422))
async def record(job_id: str, _owned: OwnedJobDep, service: ServiceDep,
                 trajectory_id: str = Query(min_length=1, max_length=1024)) -> TrajectoryDetail:
    """A finished trajectory's record without its tokens (404 until it finishes)."""
    return await service.records.detail(job_id, trajectory_id)


@router.post("/{job_id}/cancel", responses=documented(404))
async def cancel(job_id: str, _owned: OwnedJobDep, service: ServiceDep) -> JobView:
    # Nothing of a cancelled job runs or waits here any more.
    return job_view(await service.rollouts.cancel(job_id), 0, 0)


async def _view(job_id: str, service: Service) -> JobView:
    info, running, queued = await service.rollouts.job(job_id)
    window, metrics = await service.rollouts.job_policy(job_id)
    return job_view(info, running, queued).model_copy(update={
        **window, "trainer_metrics": metrics,
        "tokenizer_fingerprint": service.tokenizer_fingerprint,
        "groups_taken": await service.continuous.groups_taken(job_id)})


def job_view(info: JobInfo, running: int, queued: int) -> JobView:
    return JobView(**job_summary(info, running, queued).model_dump())


def job_summary(info: JobInfo, running: int, queued: int) -> JobSummary:
    failures = info.counts[TrajectoryStatus.ERROR]
    reason = info.reason
    if reason is None and failures and info.status is JobStatus.COMPLETED:
        reason = (f"completed with {failures} of {info.planned} trajectories ended by "
                  "infrastructure failures (status error, excluded from training)")
    return JobSummary(job_id=info.job_id, status=info.status.value, reason=reason,
                      planned=info.planned, delivered=info.delivered,
                      counts={s.value: n for s, n in info.counts.items()},
                      infrastructure_failures=failures,
                      progress=info.delivered / info.planned if info.planned else 1.0,
                      created_at=info.created_at, started_at=info.started_at,
                      finished_at=info.finished_at, running=running, queued=queued,
                      owner=info.owner)

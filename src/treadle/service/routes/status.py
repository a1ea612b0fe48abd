"""`/v1/status`: the service now and its recent history (`service.monitor`), the
admin's: like /metrics, it counts every run's work. The dashboard's chart."""

from __future__ import annotations

import time

from fastapi import APIRouter

from treadle.service.deps import AdminDep, ServiceDep
from treadle.service.strict_json import StrictJSONRoute
from treadle.service.views import SandboxPoolView, ServiceStatus, StatusSample

router = APIRouter(prefix="/v1/status", route_class=StrictJSONRoute, tags=["service"])


@router.get("")
async def status(_admin: AdminDep, service: ServiceDep) -> ServiceStatus:
    service.monitor.watched()
    rollouts, metrics = service.rollouts, service.rollouts.metrics
    sessions = service.gateway.sessions
    pools = service.sandboxes
    return ServiceStatus(
        at=time.time(), running=rollouts.live, queued=rollouts.queued,
        max_live=rollouts.max_live, tokens_generated=metrics.tokens,
        finished=dict(metrics.finished), failures=dict(metrics.failures),
        sessions=0 if sessions is None else len(sessions),
        policy_version=service.runtime.policy_version, paused=service.runtime.paused,
        sandboxes=[SandboxPoolView(suite=suite, live=s.live, idle=s.idle, in_use=s.in_use,
                                   waiting=s.waiting, created=s.created,
                                   max_live=pools.settings.max_live)
                   for suite, s in pools.stats()],
        interval_s=service.monitor.interval_s,
        series=[StatusSample.model_validate(s, from_attributes=True)
                for s in service.monitor.samples()])

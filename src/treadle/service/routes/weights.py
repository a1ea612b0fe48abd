"""`/v1/weights`: the policy version and the weight-update barrier.

A trainer key pushes (or resumes with) its own run's weights only: a weight update
or resume it sends names its run, whatever it said, and naming another run is a
403. Pausing is open to it too: the engines are shared, and a barrier is how a
trainer sharing them changes their weights."""

from __future__ import annotations

from fastapi import APIRouter

from treadle.engines.errors import WeightUpdateTimeout
from treadle.service.deps import CallerDep, ServiceDep
from treadle.service.errors import RequestRefused
from treadle.service.keys import run_named
from treadle.service.replies import documented
from treadle.service.strict_json import StrictJSONRoute
from treadle.service.weight_schemas import (
    PauseRequest,
    ResumeRequest,
    WeightsView,
    WeightUpdateRequest,
)

router = APIRouter(prefix="/v1/weights", route_class=StrictJSONRoute, tags=["weights"])


@router.get("")
async def weights(_caller: CallerDep, service: ServiceDep) -> WeightsView:
    return service.weights_view()


@router.post("/pause", responses=documented(422))
async def pause(request: PauseRequest, _caller: CallerDep, service: ServiceDep) -> WeightsView:
    await service.runtime.pause(request.mode)
    return service.weights_view()


@router.post("/update", responses=documented(422, 504))
async def update(request: WeightUpdateRequest, caller: CallerDep,
                 service: ServiceDep) -> WeightsView:
    run = run_named(caller, request.trainer_run)
    metrics = service.rollouts.metrics
    try:
        done = await service.runtime.update_weights(
            request.weights_path, request.policy_version, request.mode,
            timeout_s=request.timeout_s, trainer_run=run)
    except ValueError as e:
        raise RequestRefused(f"weights_path: {e}") from None
    except WeightUpdateTimeout:
        metrics.update_timeouts += 1
        raise
    metrics.weight_update(done.mode, done.held_s, done.kept, done.aborted)
    service.rollouts.policy_version_changed()
    service.continuous.policy_version_changed()
    return service.weights_view()


@router.post("/resume", responses=documented(422))
async def resume(request: ResumeRequest, caller: CallerDep,
                 service: ServiceDep) -> WeightsView:
    service.runtime.resume(request.policy_version,
                           trainer_run=run_named(caller, request.trainer_run))
    service.rollouts.policy_version_changed()
    service.continuous.policy_version_changed()
    return service.weights_view()

"""`/v1/weights`: the policy version and the weight-update barrier."""

from __future__ import annotations

from fastapi import APIRouter

from treadle.service.deps import ServiceDep
from treadle.service.errors import RequestRefused
from treadle.service.replies import documented
from treadle.service.schemas import (
    PauseRequest,
    ResumeRequest,
    WeightsView,
    WeightUpdateRequest,
)
from treadle.service.strict_json import StrictJSONRoute

router = APIRouter(prefix="/v1/weights", route_class=StrictJSONRoute, tags=["weights"])


@router.get("")
async def weights(service: ServiceDep) -> WeightsView:
    return service.weights_view()


@router.post("/pause", responses=documented(422))
async def pause(request: PauseRequest, service: ServiceDep) -> WeightsView:
    await service.runtime.pause(request.mode)
    return service.weights_view()


@router.post("/update", responses=documented(422))
async def update(request: WeightUpdateRequest, service: ServiceDep) -> WeightsView:
    try:
        await service.runtime.update_weights(request.weights_path, request.policy_version,
                                             request.mode, trainer_run=request.trainer_run)
    except ValueError as e:
        raise RequestRefused(f"weights_path: {e}") from None
    service.rollouts.policy_version_changed()
    return service.weights_view()


@router.post("/resume", responses=documented(422))
async def resume(request: ResumeRequest, service: ServiceDep) -> WeightsView:
    service.runtime.resume(request.policy_version, trainer_run=request.trainer_run)
    service.rollouts.policy_version_changed()
    return service.weights_view()

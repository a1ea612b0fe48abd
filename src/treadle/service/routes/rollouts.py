"""`/v1/rollouts`: one trajectory, answered when it ends."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from treadle.service.deps import ServiceDep
from treadle.service.replies import documented
from treadle.service.schemas import RolloutRequest
from treadle.service.strict_json import StrictJSONRoute

router = APIRouter(prefix="/v1/rollouts", route_class=StrictJSONRoute, tags=["rollouts"])


@router.post("", responses=documented(422))
async def rollout(request: RolloutRequest, service: ServiceDep) -> dict[str, Any]:
    return await service.rollouts.rollout(request)

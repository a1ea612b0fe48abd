"""`/v1/rollouts`: one trajectory, answered when it ends."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from treadle.service.deps import CallerDep, ServiceDep
from treadle.service.keys import owner_of
from treadle.service.replies import documented
from treadle.service.schemas import RolloutRequest
from treadle.service.strict_json import StrictJSONRoute

router = APIRouter(prefix="/v1/rollouts", route_class=StrictJSONRoute, tags=["rollouts"])


@router.post("", responses=documented(422))
async def rollout(request: RolloutRequest, caller: CallerDep,
                  service: ServiceDep) -> dict[str, Any]:
    return await service.rollouts.rollout(request, owner=owner_of(caller))

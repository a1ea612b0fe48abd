"""`/v1/engines`: the engine pools (the policy's, and the frozen one for frozen
sub-agents) — list, register, drain, remove. Engine ids are unique across pools.
Trainers may list them; changing the pools is the admin's."""

from __future__ import annotations

from fastapi import APIRouter, Response

from treadle.runtime.driver import EngineSlot
from treadle.service.deps import AdminDep, CallerDep, ServiceDep
from treadle.service.errors import RequestRefused
from treadle.service.replies import documented
from treadle.service.schemas import EngineRequest
from treadle.service.state import Service, engine_client
from treadle.service.strict_json import StrictJSONRoute
from treadle.service.views import EngineLoadView, EngineView
from treadle.store.errors import NotFound

router = APIRouter(prefix="/v1/engines", route_class=StrictJSONRoute, tags=["engines"])


@router.get("")
async def engines(_caller: CallerDep, service: ServiceDep) -> list[EngineView]:
    """With each engine's own load while someone reads this (`service.monitor`)."""
    service.monitor.watched()
    return [engine_view(service, s, pool, queues) for pool, rt in service.pools()
            for queues in [rt.scheduler.engine_queues()] for s in rt.engines()]


@router.post("", status_code=201, responses=documented(422))
async def register(request: EngineRequest, _admin: AdminDep,
                   service: ServiceDep) -> EngineView:
    engine = engine_client(request)
    problem = await service.check_engine(engine, request)
    if problem is not None:
        await engine.aclose()
        raise RequestRefused(f"{problem[0]}: {problem[1]}")
    eid = service.pool_runtime(request.pool).register_engine(
        engine, tp=request.tp, max_batch=request.max_batch,
        kv_capacity_tokens=request.kv_capacity_tokens, label=request.url)
    return engine_view(service, *_slot(service, eid), {})


@router.post("/{engine_id}/drain", responses=documented(404))
async def drain(engine_id: str, _admin: AdminDep, service: ServiceDep) -> EngineView:
    slot, pool = _slot(service, engine_id)
    service.pool_runtime(pool).drain_engine(engine_id)
    return engine_view(service, slot, pool, service.pool_runtime(pool).scheduler.engine_queues())


@router.delete("/{engine_id}", status_code=204, responses=documented(404))
async def remove(engine_id: str, _admin: AdminDep, service: ServiceDep) -> Response:
    _, pool = _slot(service, engine_id)
    service.pool_runtime(pool).remove_engine(engine_id, "removed through the API")
    return Response(status_code=204)


def engine_view(service: Service, slot: EngineSlot, pool: str,
                queues: dict[str, int]) -> EngineView:
    """`queues`: the turns the pool's scheduler holds per engine (`engine_queues`)."""
    url = getattr(slot.engine, "base_url", None)
    runtime = service.pool_runtime(pool)
    reading = service.monitor.reading(slot.engine_id)
    load = None if reading is None or reading.load is None else EngineLoadView(
        running=reading.load.running, waiting=reading.load.waiting,
        kv_usage=reading.load.kv_usage, read_at=reading.at)
    unhealthy = slot.health_failures > 0 or (reading is not None and reading.load is None)
    return EngineView(engine_id=slot.engine_id, label=slot.label,
                      url=str(url) if url is not None else None, tp=slot.tp,
                      max_batch=slot.max_batch, kv_capacity_tokens=slot.kv_capacity_tokens,
                      calls_in_flight=slot.calls, draining=slot.draining, pool=pool,
                      policy_version=runtime.policy_version,
                      queued_turns=queues.get(slot.engine_id, 0),
                      health="draining" if slot.draining else
                      "unhealthy" if unhealthy else "healthy", load=load)


def _slot(service: Service, engine_id: str) -> tuple[EngineSlot, str]:
    """The engine and the name of its pool; NotFound."""
    for pool, rt in service.pools():
        for slot in rt.engines():
            if slot.engine_id == engine_id:
                return slot, pool
    raise NotFound(f"no engine {engine_id!r}")

"""`/v1/keys`: trainer keys, the admin's to make, list and revoke (`service.keys`).

A key is shown once, in the answer that makes it; the service keeps its SHA-256
digest only (in the store, so that a restart keeps it). Revoking one refuses it at
once; what its run owns stays, for the run's other keys and the admin."""

from __future__ import annotations

from fastapi import APIRouter, Response

from treadle.service.deps import AdminDep, ServiceDep
from treadle.service.errors import RequestRefused
from treadle.service.key_schemas import KeyCreated, KeyRequest, KeyView
from treadle.service.keys import TrainerKeyView
from treadle.service.replies import documented
from treadle.service.strict_json import StrictJSONRoute

router = APIRouter(prefix="/v1/keys", route_class=StrictJSONRoute, tags=["keys"])


@router.post("", status_code=201, responses=documented(422))
async def create(body: KeyRequest, _admin: AdminDep, service: ServiceDep) -> KeyCreated:
    if not service.keys.auth:
        raise RequestRefused("trainer_run: this service has no token, so no keys: every "
                             "request is the admin's (treadle serve --token)")
    view, key = await service.keys.add_trainer_key(body.trainer_run)
    return KeyCreated(**_view(view).model_dump(), key=key)


@router.get("")
async def listed(_admin: AdminDep, service: ServiceDep) -> list[KeyView]:
    return [_view(k) for k in service.keys.trainer_keys()]


@router.delete("/{key_id}", status_code=204, responses=documented(404, 409))
async def revoke(key_id: str, _admin: AdminDep, service: ServiceDep) -> Response:
    await service.keys.revoke_trainer_key(key_id)
    return Response(status_code=204)


def _view(key: TrainerKeyView) -> KeyView:
    return KeyView(key_id=key.key_id, trainer_run=key.trainer_run, source=key.source,
                   created_at=key.created_at)

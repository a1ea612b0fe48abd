"""`GET /dashboard` and its files (`service.dashboard`): served without a key, since
they hold no data; the page asks for a key and reads everything through the
key-checked JSON routes. Not in the API's schema: they are not API."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from treadle.service.dashboard import ASSETS, HEADERS, PAGE, STATIC, asset
from treadle.store.errors import NotFound

router = APIRouter(tags=["dashboard"], include_in_schema=False)


@router.get(PAGE)
async def page() -> Response:
    return _file("dashboard.html")


@router.get(STATIC + "{name}")
async def static(name: str) -> Response:
    if name not in ASSETS or name == "dashboard.html":
        raise NotFound(f"no dashboard file {name[:64]!r}")
    return _file(name)


def _file(name: str) -> Response:
    return Response(asset(name), media_type=ASSETS[name], headers=HEADERS)

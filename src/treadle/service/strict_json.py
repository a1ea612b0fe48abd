"""Request bodies parsed as strict JSON: finite numbers, well-formed Unicode.

Python's JSON parser takes ``NaN``, ``Infinity`` and ``1e400`` (as infinity), and
``"\\ud800"`` (a lone surrogate, which no UTF-8 encoder can write back): each got
past validation and broke later — a 422 that could not itself be serialised, a
500 in the store. `StrictJSONRoute` parses bodies so that each is refused up front
as a ``json_invalid`` 422 at ``["body"]``, and so is a body nested deeper than
`MAX_DEPTH`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of the range of a double")
    return value


MAX_DEPTH = 64  # arrays and objects nested in a body; no request needs more


def _well_formed(value: Any) -> None:
    """ValueError if any string (key or value) holds a lone surrogate, or the body
    nests deeper than MAX_DEPTH (pydantic's serialiser gives up on deep nesting as if
    it were a cycle, so such a body would pass validation and fail when stored).
    Iterative: a deeply nested body must not exhaust the stack."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                item.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a surrogate
        elif isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def loads(body: bytes) -> Any:
    """`json.loads`, refusing non-finite numbers and lone surrogates: JSONDecodeError."""
    text = body.decode("utf-8")  # not UTF-8: UnicodeDecodeError, FastAPI's 400 -> 422
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
        _well_formed(value)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as e:  # (the C parser's own depth limit)
        raise json.JSONDecodeError(str(e)[:200] or "nested too deep", text[:64], 0) from None
    return value


class _StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose body is parsed by `loads`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictRequest(request.scope, request.receive))

        return strict


__all__ = ["StrictJSONRoute", "loads"]

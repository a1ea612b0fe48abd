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
import re
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


# A lone surrogate can only come from a \uD800-\uDFFF escape: raw UTF-8 cannot hold
# one (the body's decoding refuses it). A text without \uD needs no string checked;
# one with it (or with an escaped backslash before "uD") is checked in full.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD]")
_CONTAINERS = (dict, list)  # a tuple: isinstance with `dict | list` is several times slower


def _well_formed(value: Any, strings: bool = True) -> None:
    """ValueError if any string (key or value) holds a lone surrogate (only looked for
    when `strings`), or the body nests deeper than MAX_DEPTH (pydantic's serialiser
    gives up on deep nesting as if it were a cycle, so such a body would pass
    validation and fail when stored). Iterative: a deeply nested body must not
    exhaust the stack. Only containers go on the stack: a body is mostly strings,
    and walking each one cost a gateway call a tenth of a millisecond."""
    if not isinstance(value, _CONTAINERS):
        if strings and isinstance(value, str) and not value.isascii():
            value.encode("utf-8")
        return
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):  # keys are strings: looked at only for surrogates
            children = [*item.keys(), *item.values()] if strings else item.values()
        else:
            children = item
        for child in children:
            if isinstance(child, _CONTAINERS):
                stack.append((child, depth + 1))
            elif strings and isinstance(child, str) and not child.isascii():
                child.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a surrogate


def loads(body: bytes) -> Any:
    """`json.loads`, refusing non-finite numbers and lone surrogates: JSONDecodeError."""
    text = body.decode("utf-8")  # not UTF-8: UnicodeDecodeError, FastAPI's 400 -> 422
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
        _well_formed(value, strings=_SURROGATE_ESCAPE.search(text) is not None)
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

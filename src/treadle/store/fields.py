"""The parts of the trajectory record's strict reader (`treadle.store.record`).

Every check raises `RecordError` with the path of the offending value
(``segments[1].logprobs[7]``), so that a bad record names its field.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from treadle.store.errors import RecordError

_E = TypeVar("_E", bound=enum.Enum)

# JSON values of the caller's (metadata) are arbitrary; a bound keeps a hostile record
# from exhausting the stack of the recursive check.
MAX_JSON_DEPTH = 64


def int_list(value: Any, path: str) -> list[int]:
    if not isinstance(value, list):
        raise RecordError(f"{path}: must be an array of integers")
    for i, x in enumerate(value):
        if type(x) is not int or x < 0:
            raise RecordError(f"{path}[{i}]: must be a non-negative integer, got {x!r:.80}")
    return list(value)


def float_list(value: Any, path: str) -> list[float]:
    if not isinstance(value, list):
        raise RecordError(f"{path}: must be an array of numbers")
    out = list(value)
    for i, x in enumerate(out):
        if type(x) is not float:
            out[i] = as_number(x, f"{path}[{i}]")
        elif not math.isfinite(x):
            raise RecordError(f"{path}[{i}]: must be finite, got {x!r}")
    return out


def text_list(value: Any, path: str) -> list[str]:
    if not isinstance(value, list):
        raise RecordError(f"{path}: must be an array of strings")
    for i, x in enumerate(value):
        if not isinstance(x, str):
            raise RecordError(f"{path}[{i}]: must be a string, got {x!r:.80}")
    return list(value)


def as_number(x: Any, path: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise RecordError(f"{path}: must be a number, got {x!r:.80}")
    if not math.isfinite(x):
        raise RecordError(f"{path}: must be finite, got {x!r}")
    return float(x)


def json_value(x: Any, path: str, depth: int = 0) -> Any:
    """A fresh copy of `x` if it is JSON that reads back equal, else RecordError: a
    tuple would come back a list, a non-string key a string, NaN not at all."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            raise RecordError(f"{path}: must be finite, got {x!r}")
        return x
    if depth >= MAX_JSON_DEPTH:
        raise RecordError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(x, list):
        return [json_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]
    if isinstance(x, dict):
        for k in x:
            if not isinstance(k, str):
                raise RecordError(f"{path}: keys must be strings, got {k!r:.80}")
        return {k: json_value(v, f"{path}.{k}", depth + 1) for k, v in x.items()}
    raise RecordError(f"{path}: must be a JSON value (null, true/false, number, string, "
                      f"array, object), got {type(x).__name__}")


class Fields:
    """Typed access to one JSON object's fields; errors carry the object's path."""

    def __init__(self, value: Any, path: str, keys: frozenset[str]) -> None:
        where = path or "record"
        if not isinstance(value, Mapping):
            raise RecordError(f"{where}: must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - keys)
        if unknown:
            raise RecordError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
        missing = sorted(keys - set(value))
        if missing:
            raise RecordError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
        self._value = value
        self._prefix = f"{path}." if path else ""

    def value(self, key: str) -> Any:
        return self._value[key]

    def _name(self, key: str) -> str:
        return self._prefix + key

    def text(self, key: str, *, non_empty: bool = False) -> str:
        v = self._value[key]
        if not isinstance(v, str) or (non_empty and not v):
            kind = "a non-empty string" if non_empty else "a string"
            raise RecordError(f"{self._name(key)}: must be {kind}, got {v!r:.80}")
        return v

    def opt_text(self, key: str) -> str | None:
        return None if self._value[key] is None else self.text(key)

    def integer(self, key: str) -> int:
        v = self._value[key]
        if type(v) is not int or v < 0:
            raise RecordError(f"{self._name(key)}: must be a non-negative integer, "
                              f"got {v!r:.80}")
        return v

    def boolean(self, key: str) -> bool:
        v = self._value[key]
        if not isinstance(v, bool):
            raise RecordError(f"{self._name(key)}: must be true or false, got {v!r:.80}")
        return v

    def number(self, key: str) -> float:
        return as_number(self._value[key], self._name(key))

    def opt_number(self, key: str) -> float | None:
        return None if self._value[key] is None else self.number(key)

    def array(self, key: str) -> list[Any]:
        v = self._value[key]
        if not isinstance(v, list):
            raise RecordError(f"{self._name(key)}: must be an array")
        return v

    def choice(self, key: str, cls: type[_E]) -> _E:
        v = self._value[key]
        try:
            return cls(v)
        except ValueError:
            allowed = " | ".join(str(m.value) for m in cls)
            raise RecordError(f"{self._name(key)}: must be one of {allowed}, "
                              f"got {v!r:.80}") from None

    def opt_choice(self, key: str, cls: type[_E]) -> _E | None:
        return None if self._value[key] is None else self.choice(key, cls)

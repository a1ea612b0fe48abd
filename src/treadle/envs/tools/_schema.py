"""A small JSON-schema checker for tool arguments, and the function-spec builder.

Models write tool arguments as JSON; this checks them against the tool's
`parameters` schema before the tool runs, so that a tool body only sees well-typed
arguments and the model gets one precise message listing every problem.

Supported keywords (the subset tool schemas use): ``type`` (a name or a list of
names: object, array, string, integer, number, boolean, null), ``properties``,
``required``, ``additionalProperties`` (only ``false`` is enforced), ``items``,
``enum``, ``minimum``, ``maximum``, ``minLength``, ``maxLength``, ``minItems``,
``maxItems``. Anything else (``pattern``, ``oneOf``, ``$ref``...) is ignored, not
rejected. Booleans are not integers or numbers here, unlike in Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def function_spec(name: str, description: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI/Hermes function-calling entry for a tool (what chat templates render)."""
    return {"type": "function",
            "function": {"name": name, "description": description,
                         "parameters": dict(parameters)}}


def _is_type(value: Any, name: str) -> bool:
    kinds = _TYPES.get(name)
    if kinds is None:
        return True  # an unknown type name constrains nothing
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, kinds)


def check(schema: Mapping[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """Every way `value` violates `schema`, as readable sentences; [] when it conforms."""
    problems: list[str] = []
    wanted = schema.get("type")
    if wanted is not None:
        names = [wanted] if isinstance(wanted, str) else list(wanted)
        if not any(_is_type(value, n) for n in names):
            got = "null" if value is None else type(value).__name__
            got = {"dict": "object", "list": "array", "str": "string", "int": "integer",
                   "float": "number", "bool": "boolean"}.get(got, got)
            return [f"{where} must be {' or '.join(names)}, got {got}"]
    if "enum" in schema and value not in schema["enum"]:
        options = ", ".join(repr(o) for o in schema["enum"])
        problems.append(f"{where} must be one of {options}, got {value!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{where} must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{where} must be <= {schema['maximum']}, got {value}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            problems.append(f"{where} must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            problems.append(f"{where} must have at most {schema['maxLength']} characters, "
                            f"got {len(value)}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            problems.append(f"{where} must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(f"{where} must have at most {schema['maxItems']} items")
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                problems += check(items, item, f"{where}[{i}]")
    if isinstance(value, dict):
        problems += _check_object(schema, value, where)
    return problems


def _check_object(schema: Mapping[str, Any], value: dict[str, Any], where: str) -> list[str]:
    problems: list[str] = []
    properties: Mapping[str, Any] = schema.get("properties", {})
    prefix = "" if where == "arguments" else f"{where}."
    for name in schema.get("required", []):
        if name not in value:
            problems.append(f"missing required argument {prefix}{name!r}")
    if schema.get("additionalProperties") is False:
        extra = sorted(k for k in value if k not in properties)
        if extra:
            allowed = ", ".join(repr(k) for k in properties) or "none"
            problems.append(f"unknown argument(s) {', '.join(repr(prefix + k) for k in extra)}; "
                            f"allowed: {allowed}")
    for name, sub in properties.items():
        if name in value and isinstance(sub, Mapping):
            problems += check(sub, value[name], f"{prefix}{name}")
    return problems

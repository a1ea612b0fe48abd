"""`strict_json.loads`: lone surrogates and deep nesting refused wherever they are,
whether or not the text's escapes suggest a surrogate (its strings are looked at
only when one could be there)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from treadle.service.strict_json import MAX_DEPTH, loads


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("text", [
    '{"a": "\\ud800"}', '{"a": "\\uD800"}', '{"a": "x\\uDFFFy"}', '{"\\udc00": 1}',
    '["ok", {"b": [["\\uDbFf"]]}]', '"\\ud800"',
])
def test_a_lone_surrogate_is_refused(text: str) -> None:
    with pytest.raises(json.JSONDecodeError, match="surrogates not allowed"):
        loads(text.encode())


@pytest.mark.parametrize(("text", "value"), [
    ('{"a": "\\\\ud800"}', {"a": "\\ud800"}),  # an escaped backslash, then text
    ('{"a": "\\ud83d\\ude00"}', {"a": "\U0001F600"}),  # a pair: one code point
    ('{"a": "caf\u00e9 \u4e2d"}', {"a": "caf\u00e9 \u4e2d"}),  # raw UTF-8
])
def test_text_without_a_lone_surrogate_passes(text: str, value: Any) -> None:
    assert loads(text.encode()) == value


def test_nesting_is_bounded_with_or_without_escapes() -> None:
    for suffix in ("", "\\ud83d\\ude00"):
        deepest = json.dumps({"s": suffix, "v": _nested(MAX_DEPTH - 1)}).replace(
            "\\\\", "\\")
        assert loads(deepest.encode())["v"] == _nested(MAX_DEPTH - 1)
        too_deep = json.dumps({"s": suffix, "v": _nested(MAX_DEPTH)}).replace("\\\\", "\\")
        with pytest.raises(json.JSONDecodeError, match="nested deeper"):
            loads(too_deep.encode())

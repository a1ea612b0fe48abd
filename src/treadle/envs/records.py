"""Task records: reading user JSONL, checking fields, deterministic seeding.

A suite's task format is a JSON object per line. Every format has an ``"id"``
(string, unique within the file); the other fields are the suite's (documented in
docs/suites.md and in each suite's module docstring). Readers here raise
`TaskFormatError` naming the field, and `load_jsonl` adds the path and line.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from treadle.envs.errors import TaskFormatError


def rng_for(*parts: object) -> random.Random:
    """A Random seeded from `parts` (e.g. suite, seed, index), identical in every process.

    String seeds go through SHA-512 inside `random.Random`, so the stream does not
    depend on PYTHONHASHSEED; one stream per task makes `tasks(n)` a prefix of
    `tasks(n + 1)`.
    """
    return random.Random(":".join(str(p) for p in parts))


def stable_id(prefix: str, payload: Any) -> str:
    """`prefix-<12 hex>` from the canonical JSON of `payload` (for records without an id)."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return f"{prefix}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


MAX_JSONL_BYTES = 1 << 30  # the largest task file read_jsonl reads


def read_jsonl(path: str | Path, *,
               max_bytes: int = MAX_JSONL_BYTES) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; TaskFormatError on bad JSON, or
    on anything but a regular file of at most `max_bytes` (a FIFO, a device such as
    /dev/zero and a directory are refused before a byte is read); OSError if it
    cannot be opened."""
    # O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # OSError as before
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TaskFormatError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise TaskFormatError(f"{path}: {st.st_size} bytes, over the limit of {max_bytes}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        budget = max_bytes  # a file that grows while it is read stops at the limit too
        number = 0
        while raw := f.readline(budget + 1):
            budget -= len(raw)
            if budget < 0:
                raise TaskFormatError(f"{path}: over the limit of {max_bytes} bytes")
            # Lines end at \n, \r\n or a lone \r, as text mode reads them.
            for piece in raw.replace(b"\r\n", b"\n").split(b"\r"):
                number += 1
                yield from _record(path, number, piece)


def _record(path: str | Path, number: int, raw: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    """The line's object (none for a blank line); TaskFormatError naming the line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskFormatError(f"{path}:{number}: not UTF-8 text") from None
    if not line.strip():
        return
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskFormatError(f"{path}:{number}: not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise TaskFormatError(f"{path}:{number}: each line must be a JSON object")
    yield number, value


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    """One JSON object per line, keys sorted (byte-identical for equal records)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n")


def req_str(record: Mapping[str, Any], key: str, *, allow_empty: bool = False) -> str:
    value = record.get(key)
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise TaskFormatError(f"field {key!r} must be a non-empty string, got {value!r:.80}")
    return value


def opt_str(record: Mapping[str, Any], key: str, default: str | None = None) -> str | None:
    value = record.get(key, default)
    if value is not None and not isinstance(value, str):
        raise TaskFormatError(f"field {key!r} must be a string, got {value!r:.80}")
    return value


def opt_float(record: Mapping[str, Any], key: str, default: float) -> float:
    value = record.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TaskFormatError(f"field {key!r} must be a number, got {value!r:.80}")
    return float(value)


def req_list(record: Mapping[str, Any], key: str, *, min_items: int = 1) -> list[Any]:
    value = record.get(key)
    if not isinstance(value, list) or len(value) < min_items:
        raise TaskFormatError(f"field {key!r} must be a list of at least {min_items} item(s)")
    return value


def req_dict(record: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = record.get(key)
    if not isinstance(value, dict):
        raise TaskFormatError(f"field {key!r} must be a JSON object")
    return value


def check_keys(record: Mapping[str, Any], allowed: set[str]) -> None:
    """Refuse unknown fields: a typo ("answr") must not silently drop the answer."""
    unknown = sorted(set(record) - allowed - {"id"})
    if unknown:
        raise TaskFormatError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: "
                              f"{', '.join(sorted(allowed | {'id'}))}")

"""The SWE-bench-style instance format: one task = a repository in an image, a bug, its tests.

One JSON object per line::

    {"instance_id": "six-add-metaclass-qualname", "repo": "benjaminp/six",
     "base_commit": "1.17.0", "problem_statement": "add_metaclass loses ...",
     "patch": "--- a/six.py\\n+++ b/six.py\\n...", "test_patch": "--- a/test_six.py\\n...",
     "FAIL_TO_PASS": ["test_six.py::test_add_metaclass_nested"],
     "PASS_TO_PASS": ["test_six.py::test_add_metaclass"],
     "image": "images/six.oci.tar", "test_cmd": "python3 -m pytest", "workdir": "/testbed"}

``image`` is an image ref as `treadle.sandbox.images` accepts it (a root file
system dir, an OCI layout dir, an OCI or `docker save` archive); a relative path is
relative to the JSONL file. The image holds the repository at ``base_commit`` with
its dependencies installed, in its config's ``WorkingDir`` (or ``workdir``, which
must then equal it). ``patch`` (the gold fix) is never shown to the model.
``FAIL_TO_PASS``/``PASS_TO_PASS`` are pytest node ids (``path::Class::test[param]``),
as lists or as JSON strings of lists (the Hugging Face SWE-bench datasets store
them so). The optional SWE-bench fields ``hints_text``, ``created_at``,
``version`` and ``environment_setup_commit`` are accepted and kept; any other
field is refused, so that a typo cannot drop a test list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from treadle.envs.errors import TaskFormatError

DEFAULT_TEST_CMD = "python3 -m pytest"


class SweInstance(BaseModel):
    """One SWE-bench-style instance (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    base_commit: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    patch: str = ""
    test_patch: str = ""
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    image: str = Field(min_length=1)
    test_cmd: str | None = None
    workdir: str | None = None
    hints_text: str | None = None
    created_at: str | None = None
    version: str | None = None
    environment_setup_commit: str | None = None

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # SWE-bench's datasets: a JSON string of a list
            try:
                return json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"a JSON string of a list was expected: {e.msg}") from None
        return value

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS")
    @classmethod
    def _node_ids(cls, value: list[str]) -> list[str]:
        for test in value:
            if not test.strip() or test != test.strip() or "\n" in test:
                raise ValueError(f"{test!r} is not a pytest node id")
        if len(set(value)) != len(value):
            raise ValueError("a test id is listed twice")
        return value

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or ".." in value.split("/")):
            raise ValueError(f"{value!r} must be an absolute path without '..'")
        return value

    @property
    def command(self) -> str:
        """The test command the test ids are appended to."""
        return self.test_cmd or DEFAULT_TEST_CMD

    def record(self) -> dict[str, Any]:
        """The JSONL record (optional fields left out when unset)."""
        return self.model_dump(exclude_none=True)


def parse_instance(record: Mapping[str, Any]) -> SweInstance:
    """An instance from one record; TaskFormatError naming the first bad field."""
    try:
        instance = SweInstance.model_validate(dict(record))
    except ValidationError as e:
        problems = []
        for error in e.errors():
            where = ".".join(str(part) for part in error["loc"]) or "record"
            message = ("unknown field" if error["type"] == "extra_forbidden"
                       else error["msg"])
            problems.append(f"field {where!r}: {message}")
        raise TaskFormatError("; ".join(problems)) from None
    overlap = set(instance.FAIL_TO_PASS) & set(instance.PASS_TO_PASS)
    if overlap:
        raise TaskFormatError(f"field 'PASS_TO_PASS': {sorted(overlap)[0]!r} is also in "
                              "FAIL_TO_PASS")
    return instance

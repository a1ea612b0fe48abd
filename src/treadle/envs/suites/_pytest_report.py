"""Per-test outcomes from pytest's `-rA` short test summary, by node id.

`pytest -rA` ends with a "short test summary info" section: one line per test,
``PASSED path::test``, ``FAILED path::test - message``, ``ERROR path::test - ...``,
``XFAIL path::test - reason``, ``XPASS path::test ...`` (skips name no node id).
Only the lines after the *last* such header are read, so text a test prints (shown
by -rA in the "PASSES" section, above the summary) cannot pose as a result. A test
asked for but absent from the summary (not collected, skipped, the run crashed) is
`MISSING`. Limit: code that prints after pytest's summary (an atexit hook) can
still forge lines; this catches honest failures, not an adversary.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

_HEADER = re.compile(r"^=+ short test summary info =+\s*$")
_STATUSES = ("PASSED", "FAILED", "ERROR", "XFAIL", "XPASS")


class Outcome(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    XFAIL = "xfail"
    XPASS = "xpass"
    MISSING = "missing"

    @property
    def ok(self) -> bool:
        """Counts as a pass (as SWE-bench's grading counts PASSED and XFAIL)."""
        return self in (Outcome.PASSED, Outcome.XFAIL)


def outcomes(output: str, tests: Iterable[str]) -> dict[str, Outcome]:
    """The outcome of each of `tests` (pytest node ids) in pytest's -rA output."""
    lines = output.splitlines()
    start = None
    for i, line in enumerate(lines):
        if _HEADER.match(line):
            start = i + 1
    found: dict[str, list[Outcome]] = {}
    if start is not None:
        for line in lines[start:]:
            status, _, rest = line.partition(" ")
            if status not in _STATUSES:
                continue
            heads = {rest.rstrip()}  # a PASSED line is the id alone
            head = rest
            while " - " in head:  # FAILED id - message; an id may itself hold " - "
                head = head.rsplit(" - ", 1)[0]
                heads.add(head)
            for key in heads:
                found.setdefault(key, []).append(Outcome[status])
    result: dict[str, Outcome] = {}
    for test in tests:
        seen = found.get(test, [])
        # A test that passed but errored in teardown is listed twice: the error wins.
        bad = [o for o in seen if not o.ok]
        result[test] = bad[0] if bad else seen[0] if seen else Outcome.MISSING
    return result

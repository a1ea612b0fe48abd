"""What the `treadle bench` commands share: their progress line and their report file."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def log(message: str) -> None:
    """One progress line on stderr, prefixed like every treadle message."""
    print(f"treadle: {message}", file=sys.stderr, flush=True)


def write_report(report: Mapping[str, Any], out: str | Path, *, name: str,
                 echo: bool = False) -> None:
    """Write `report` as indented JSON to `out` (folders made), say where, and print it
    on stdout too when `echo` (the `--json` flag)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    path.write_text(text + "\n")
    log(f"{name}: report written to {path}")
    if echo:
        print(text)

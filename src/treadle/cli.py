"""Command line: `treadle sim | bench | demo`. Imports are lazy so `--help` is instant."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("treadle: not yet wired", file=sys.stderr)
    return 2

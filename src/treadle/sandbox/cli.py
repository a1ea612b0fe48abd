"""`treadle sandbox exec`: run one command in a fresh sandbox and print a JSON result.

    treadle sandbox exec --backend bwrap --timeout 5 --memory-mb 256 -- python3 -c 'print(1)'

Prints one JSON object on stdout: exit_code, stdout, stderr, timed_out, killed,
duration_s (and truncated). Exits 0 whenever the command ran, whatever it did (its
status is in the JSON); exits 2 with one line on stderr for bad input or a backend
that cannot run here (e.g. bwrap not installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from treadle.errors import SandboxError


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `sandbox exec` on the main CLI's subparsers; handler in `args.func`."""
    sandbox = subparsers.add_parser("sandbox", help="run commands in sandboxes")
    commands = sandbox.add_subparsers(dest="sandbox_command", required=True)
    run = commands.add_parser("exec", help="run one command in a fresh sandbox, print JSON")
    # Values are checked in run_exec, not by argparse, so that bad input gives one
    # line on stderr rather than a usage dump.
    run.add_argument("--backend", default="bwrap", metavar="{bwrap,local}",
                     help="bwrap isolates; local is for development and isolates nothing")
    run.add_argument("--timeout", default="30", metavar="S",
                     help="wall-clock limit in seconds (default 30)")
    run.add_argument("--memory-mb", default="512", metavar="M",
                     help="memory limit in MiB (default 512)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                     help="the command and its arguments, after --")
    run.set_defaults(func=run_exec)


def run_exec(args: argparse.Namespace) -> int:
    """Handler of `sandbox exec`: 0 with the JSON result, 2 with an error line."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        return _fail("no command given; usage: treadle sandbox exec [options] -- CMD ...")
    try:
        timeout_s = float(args.timeout)
        memory_mb = int(args.memory_mb)
    except ValueError:
        return _fail("--timeout must be a number of seconds and --memory-mb an integer")
    if not timeout_s > 0 or memory_mb <= 0:
        return _fail("--timeout and --memory-mb must be positive")
    from treadle.sandbox.registry import BACKENDS, exec_once  # lazy: keep --help fast

    if args.backend not in BACKENDS:
        return _fail(f"unknown backend {args.backend!r}; choose one of "
                     f"{', '.join(sorted(BACKENDS))}")
    try:
        result = asyncio.run(exec_once(args.backend, argv, timeout_s, memory_mb))
    except (SandboxError, ValueError, KeyError) as e:
        return _fail(str(e).strip("'\""))
    print(json.dumps({
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "timed_out": result.timed_out,
        "killed": result.killed,
        "duration_s": round(result.duration_s, 4),
        "truncated": result.truncated,
    }))
    return 0


def _fail(message: str) -> int:
    print(f"treadle sandbox: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (tests, `python -m treadle.sandbox.cli`): `sandbox exec ...`."""
    parser = argparse.ArgumentParser(prog="treadle")
    add_parser(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse already printed a usage line
        return 2 if e.code else 0
    handler = args.func
    code: int = handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

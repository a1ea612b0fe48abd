"""`python` and `bash`: run model-written code in the episode's sandbox.

Both run in the sandbox's work dir (the cwd; files persist between calls, processes
do not) under the sandbox's `Limits`, with a per-call timeout that the sandbox
clamps to its wall ceiling. `PythonTool(session=True)` runs each call as a cell of
the sandbox's Python session instead (`Sandbox.run_cell`: variables and imports
persist, as in a notebook), on a sandbox that keeps one. The observation is stdout,
then stderr under a ``[stderr]`` line, cut to `max_output_chars` (head and tail
kept). A non-zero exit, a kill (timeout, memory, CPU, output cap) or a truncation
sets `error`, so the model is told plainly that its code failed and why.
"""

from __future__ import annotations

from typing import Any

from treadle.envs.tools.base import (
    DEFAULT_MAX_OUTPUT_CHARS,
    Tool,
    ToolContext,
    ToolReplay,
    ToolResult,
    clip,
)
from treadle.sandbox.base import ExecResult

MAX_CODE_CHARS = 100_000  # one argv element must stay under the kernel's 128 KiB
# No .pyc files: CPython validates a cached .pyc by the source's mtime (whole seconds)
# and size, so an edit that keeps the size within the same second would run stale code.
DEFAULT_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}

_KILL_WORDS = {
    "timeout": "it was killed at the time limit",
    "memory": "it was killed for using too much memory",
    "cpu": "it was killed at the CPU-time limit",
    "file_size": "it was killed for writing a file over the size limit",
    "output_limit": "it was killed for printing too much output",
}


def render_exec(result: ExecResult, timeout_s: float,
                max_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> ToolResult:
    """The observation of one exec: output text plus an error sentence when it failed."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    output = clip("\n".join(parts), max_chars) if parts else "(no output)"
    error: str | None = None
    if result.killed == "timeout":
        error = f"timed out after {timeout_s:g} s; {_KILL_WORDS['timeout']}"
    elif result.killed is not None:
        reason = _KILL_WORDS.get(result.killed, f"it was killed ({result.killed})")
        error = f"the command did not finish: {reason}"
    elif result.exit_code != 0:
        error = f"exit status {result.exit_code}"
    if result.truncated and error is None:
        error = "output truncated"
    return ToolResult(output=output, error=error)


class PythonTool(Tool):
    """Runs a Python program (`python3 -`, code on stdin) in the sandbox; with
    `session`, a cell of the sandbox's Python session (SandboxUnsupported from a
    sandbox that keeps none: a configuration error, not the model's)."""

    replay = ToolReplay.RERUN  # resumed: its files and outputs follow from the code

    def __init__(self, *, timeout_s: float = 20.0, python: str = "python3",
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
                 session: bool = False) -> None:
        self.timeout_s = timeout_s
        self.python = python
        self.max_output_chars = max_output_chars
        self.session = session

    @property
    def name(self) -> str:
        return "python"

    @property
    def description(self) -> str:
        if self.session:
            return (f"Run Python 3 code in a persistent session, like a notebook cell, and "
                    f"return what it prints (stdout, then stderr). Variables, functions "
                    f"and imports stay for your next call, and files you write persist; "
                    f"processes you start do not, and a call that leaves a thread running "
                    f"is not kept. A call that times out or crashes leaves the session as "
                    f"it was before it. Use print() to see values. No network. "
                    f"Time limit {self.timeout_s:g} s.")
        return (f"Run a Python 3 program and return what it prints (stdout, then stderr). "
                f"Each call is a fresh process in the task's working directory: files you "
                f"write persist, variables do not. Use print() to see values. No network. "
                f"Time limit {self.timeout_s:g} s.")

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"code": {"type": "string", "description": "the program",
                                        "minLength": 1, "maxLength": MAX_CODE_CHARS}},
                "required": ["code"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        sandbox = ctx.require_sandbox()
        code = arguments["code"].encode()
        if self.session:
            result = await sandbox.run_cell(code, timeout_s=self.timeout_s, python=self.python,
                                            env=DEFAULT_ENV)
        else:  # -u: unbuffered, so output printed before a crash or a kill is not lost
            result = await sandbox.exec([self.python, "-u", "-"], timeout_s=self.timeout_s,
                                        stdin=code, env=DEFAULT_ENV)
        return render_exec(result, self.timeout_s, self.max_output_chars)


class BashTool(Tool):
    """Runs one bash command line (`bash -c`) in the sandbox."""

    replay = ToolReplay.RERUN  # resumed: its effects on the work dir follow from the command

    def __init__(self, *, timeout_s: float = 20.0,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars

    @property
    def name(self) -> str:
        return "bash"

    @property
    def description(self) -> str:
        return (f"Run a bash command line in the task's working directory and return its "
                f"output (stdout, then stderr). Files persist between calls; background "
                f"processes do not. No network. Time limit {self.timeout_s:g} s.")

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"command": {"type": "string", "description": "the command line",
                                           "minLength": 1, "maxLength": MAX_CODE_CHARS}},
                "required": ["command"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        sandbox = ctx.require_sandbox()
        result = await sandbox.exec(["bash", "-c", arguments["command"]],
                                    timeout_s=self.timeout_s, stdin=b"", env=DEFAULT_ENV)
        return render_exec(result, self.timeout_s, self.max_output_chars)

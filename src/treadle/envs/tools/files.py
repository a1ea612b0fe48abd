"""`read_file` and `write_file`: the sandbox work dir through the sandbox's file API.

Paths are relative to the work dir (or absolute under it, e.g. /work/pkg/core.py).
The sandbox layer refuses ``..``, paths elsewhere and symlinks anywhere on the path;
those refusals, a missing file, a directory or an oversized file become error
observations. Nothing here runs a process, so these tools are cheap.
"""

from __future__ import annotations

from typing import Any

from treadle.envs.tools.base import (
    DEFAULT_MAX_OUTPUT_CHARS,
    Tool,
    ToolContext,
    ToolInputError,
    ToolReplay,
    ToolResult,
    clip,
)

MAX_READ_BYTES = 1024 * 1024  # a bigger file is refused; read it in pieces with bash
MAX_WRITE_CHARS = 1024 * 1024


class ReadFileTool(Tool):
    """Returns a text file's content, optionally a range of lines."""

    replay = ToolReplay.NONE  # resumed: reads only

    def __init__(self, *, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS * 2) -> None:
        self.max_output_chars = max_output_chars

    @property
    def name(self) -> str:
        return "read_file"

    @property
    def description(self) -> str:
        return ("Read a text file in the working directory. Give a path relative to it. "
                "Optionally start_line (1-based) and num_lines to read part of a long file.")

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {
                    "path": {"type": "string", "minLength": 1},
                    "start_line": {"type": "integer", "minimum": 1},
                    "num_lines": {"type": "integer", "minimum": 1},
                },
                "required": ["path"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        sandbox = ctx.require_sandbox()
        data = await sandbox.get_file(arguments["path"], max_bytes=MAX_READ_BYTES)
        if b"\x00" in data[:4096]:
            raise ToolInputError(f"{arguments['path']} looks like a binary file; "
                                 "inspect it with bash instead")
        text = data.decode("utf-8", errors="replace")
        start = arguments.get("start_line")
        count = arguments.get("num_lines")
        if start is not None or count is not None:
            lines = text.splitlines(keepends=True)
            first = (start or 1) - 1
            if first >= len(lines) and lines:
                raise ToolInputError(f"start_line {first + 1} is past the end of "
                                     f"{arguments['path']} ({len(lines)} lines)")
            text = "".join(lines[first:first + count] if count else lines[first:])
        return ToolResult(output=clip(text, self.max_output_chars) if text else "(empty file)")


class WriteFileTool(Tool):
    """Creates or replaces a file (parent directories are created)."""

    replay = ToolReplay.RERUN  # resumed: the file is written again

    @property
    def name(self) -> str:
        return "write_file"

    @property
    def description(self) -> str:
        return ("Write a text file in the working directory, replacing it if it exists "
                "(parent directories are created). Give the complete new content.")

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {
                    "path": {"type": "string", "minLength": 1},
                    "content": {"type": "string", "maxLength": MAX_WRITE_CHARS},
                },
                "required": ["path", "content"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        sandbox = ctx.require_sandbox()
        data = arguments["content"].encode()
        await sandbox.put_file(arguments["path"], data)
        return ToolResult(output=f"wrote {len(data)} bytes to {arguments['path']}")

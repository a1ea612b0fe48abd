"""`apply_patch`: apply a unified diff to files in the sandbox work dir.

Pure Python on the host side (reads and writes go through the sandbox's file API;
only a deletion runs ``rm`` in the sandbox), so it does not depend on `patch` or
`git` being installed in the sandbox image.

What it accepts: one or more files, each ``--- old`` / ``+++ new`` then ``@@`` hunks;
git headers (``diff --git``, ``index``, modes) are skipped; ``a/``/``b/`` prefixes
are stripped; ``/dev/null`` creates or deletes a file. Models often get hunk counts
or line numbers wrong, so both are hints only: a hunk is located by its context and
removed lines, nearest to the stated line, first exactly and then ignoring trailing
whitespace. A blank line inside a hunk is read as an empty context line.

All or nothing: every hunk of every file is matched before anything is written; on
the first mismatch nothing changes and the error names the file and hunk and shows
the lines that were expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from treadle.envs.errors import EnvError
from treadle.envs.tools.base import Tool, ToolContext, ToolInputError, ToolReplay, ToolResult
from treadle.errors import SandboxFileError
from treadle.sandbox.base import Sandbox

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_SKIP = ("diff ", "index ", "new file mode", "deleted file mode", "old mode", "new mode",
         "similarity index", "rename from", "rename to", "Binary files")
DEV_NULL = "/dev/null"
MAX_PATCH_CHARS = 500_000


class PatchError(EnvError, ValueError):
    """The diff is malformed or does not apply; the message is for the model."""


@dataclass(slots=True)
class Hunk:
    old_start: int  # 1-based line of the old file the hunk claims to start at (a hint)
    lines: list[tuple[str, str]] = field(default_factory=list)  # (' ', '-' or '+', text)
    no_newline_at_end: bool = False  # '\ No newline at end of file' after a new-side line

    @property
    def old(self) -> list[str]:
        return [text for op, text in self.lines if op != "+"]

    @property
    def new(self) -> list[str]:
        return [text for op, text in self.lines if op != "-"]


@dataclass(slots=True)
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        path = self.new_path if self.new_path is not None else self.old_path
        assert path is not None  # parse_unified_diff refuses /dev/null on both sides
        return path


def _clean_path(raw: str) -> str | None:
    path = raw.split("\t", 1)[0].strip()
    if path.startswith('"') and path.endswith('"') and len(path) > 1:
        path = path[1:-1]
    return None if path == DEV_NULL else path


def _strip_prefixes(patches: list[FilePatch]) -> None:
    """Drop git's a/ and b/ prefixes when every path carries them."""
    olds = [p.old_path for p in patches if p.old_path is not None]
    news = [p.new_path for p in patches if p.new_path is not None]
    if all(o.startswith("a/") for o in olds) and all(n.startswith("b/") for n in news):
        for p in patches:
            p.old_path = p.old_path[2:] if p.old_path is not None else None
            p.new_path = p.new_path[2:] if p.new_path is not None else None


def parse_unified_diff(text: str) -> list[FilePatch]:
    """The file patches of a unified diff; PatchError if there are none or it is malformed."""
    lines = text.splitlines()
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _clean_path(line[4:]), _clean_path(lines[i + 1][4:])
            if old is None and new is None:
                raise PatchError(f"line {i + 1}: both sides are /dev/null")
            patches.append(FilePatch(old, new))
            i += 2
        elif line.startswith("@@"):
            if not patches:
                raise PatchError(f"line {i + 1}: hunk before any '--- a/file' / '+++ b/file' "
                                 "header")
            match = _HUNK.match(line)
            if match is None:
                raise PatchError(f"line {i + 1}: malformed hunk header {line!r}; expected "
                                 "'@@ -start,count +start,count @@'")
            hunk, i = _read_hunk(lines, i + 1, match)
            patches[-1].hunks.append(hunk)
        elif line.startswith(_SKIP) or not line.strip() or not patches:
            i += 1  # git metadata, blank lines, or prose before the first header
        else:
            raise PatchError(f"line {i + 1}: unexpected text outside a hunk: {line[:80]!r}")
    if not patches:
        raise PatchError("no file headers found; a unified diff starts with "
                         "'--- a/path' and '+++ b/path' lines, then '@@' hunks")
    for p in patches:
        if not p.hunks and p.new_path is not None:
            raise PatchError(f"{p.path}: no hunks")
    _strip_prefixes(patches)
    return patches


def _read_hunk(lines: list[str], i: int, match: re.Match[str]) -> tuple[Hunk, int]:
    old_left = int(match.group(2)) if match.group(2) is not None else 1
    new_left = int(match.group(4)) if match.group(4) is not None else 1
    hunk = Hunk(old_start=int(match.group(1)))
    while i < len(lines):
        line = lines[i]
        satisfied = old_left <= 0 and new_left <= 0
        if line.startswith("@@") or line.startswith("diff "):
            break
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            break
        if line.startswith("\\"):
            if hunk.lines and hunk.lines[-1][0] != "-":
                hunk.no_newline_at_end = True
            i += 1
            continue
        if line == "":
            if satisfied:
                break
            op, body = " ", ""  # a context line whose leading space was lost
        elif line[0] in " -+":
            op, body = line[0], line[1:]
        else:
            break
        hunk.lines.append((op, body))
        old_left -= op != "+"
        new_left -= op != "-"
        i += 1
    if not hunk.lines:
        raise PatchError(f"empty hunk at line {i}")
    return hunk, i


def _find(lines: list[str], block: list[str], hint: int, lo: int) -> tuple[int, bool] | None:
    """Where `block` occurs in lines[lo:], nearest to `hint`; (index, exact) or None."""
    n = len(block)
    candidates = sorted(range(lo, len(lines) - n + 1), key=lambda k: (abs(k - hint), k))
    for exact in (True, False):
        for k in candidates:
            window = lines[k:k + n]
            if exact and window == block:
                return k, True
            if not exact and [w.rstrip() for w in window] == [b.rstrip() for b in block]:
                return k, False
    return None


def apply_hunks(content: str, hunks: list[Hunk], path: str = "file") -> tuple[str, list[str]]:
    """`content` with `hunks` applied, plus notes (offsets, whitespace); PatchError on mismatch."""
    ends_with_newline = content.endswith("\n") or content == ""
    lines = content.split("\n")
    if content.endswith("\n"):
        lines.pop()
    elif content == "":
        lines = []
    notes: list[str] = []
    lo = 0
    for number, hunk in enumerate(hunks, 1):
        old = hunk.old
        hint = max(hunk.old_start - 1, 0) if old else min(hunk.old_start, len(lines))
        if not old:  # pure insertion: no context to find, trust the line number
            at, exact = max(min(hint, len(lines)), lo), True
        else:
            found = _find(lines, old, hint, lo)
            if found is None:
                expected = "\n".join(old[:8]) + ("\n..." if len(old) > 8 else "")
                raise PatchError(f"{path}: hunk {number} does not apply; these lines were not "
                                 f"found in order:\n{expected}")
            at, exact = found
        if at != hint and old:
            notes.append(f"hunk {number} applied at line {at + 1} (diff said {hunk.old_start})")
        if not exact:
            notes.append(f"hunk {number} matched ignoring trailing whitespace")
        # Context lines keep the file's text (they may differ in trailing whitespace).
        actual = iter(lines[at:at + len(old)])
        replacement = []
        for op, text in hunk.lines:
            if op == "+":
                replacement.append(text)
            elif op == " ":
                replacement.append(next(actual))
            else:
                next(actual)
        lines[at:at + len(old)] = replacement
        lo = at + len(replacement)
        if hunk.no_newline_at_end and lo == len(lines):
            ends_with_newline = False
    text = "\n".join(lines)
    return (text + "\n" if ends_with_newline and lines else text), notes


async def _read(sandbox: Sandbox, path: str) -> str | None:
    try:
        return (await sandbox.get_file(path)).decode("utf-8")
    except SandboxFileError:
        return None
    except UnicodeDecodeError:
        raise ToolInputError(f"{path} is not a UTF-8 text file") from None


class ApplyPatchTool(Tool):
    """Applies a unified diff (see the module docstring for what is accepted)."""

    replay = ToolReplay.RERUN  # resumed: the patch is applied again, in order

    @property
    def name(self) -> str:
        return "apply_patch"

    @property
    def description(self) -> str:
        return ("Apply a unified diff (as made by `diff -u` or `git diff`) to files in the "
                "working directory. Each file starts with '--- a/path' and '+++ b/path' "
                "lines followed by '@@ -l,n +l,n @@' hunks with context lines. Use "
                "/dev/null as the old path to create a file, as the new path to delete one. "
                "Either every hunk applies or nothing changes.")

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"patch": {"type": "string", "minLength": 1,
                                         "maxLength": MAX_PATCH_CHARS}},
                "required": ["patch"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        sandbox = ctx.require_sandbox()
        try:
            patches = parse_unified_diff(arguments["patch"])
        except PatchError as e:
            raise ToolInputError(f"cannot parse the patch: {e}") from None
        writes: dict[str, str] = {}
        deletes: list[str] = []
        summary: list[str] = []
        for p in patches:
            current = writes.get(p.path)
            if current is None and p.path not in deletes:
                current = await _read(sandbox, p.old_path or p.path)
            if p.old_path is None and current:
                raise ToolInputError(f"{p.path} already exists; cannot create it")
            if p.old_path is not None and current is None:
                raise ToolInputError(f"{p.old_path}: no such file in the working directory")
            if p.new_path is None:
                deletes.append(p.path)
                writes.pop(p.path, None)
                summary.append(f"deleted {p.path}")
                continue
            try:
                result, notes = apply_hunks(current or "", p.hunks, p.path)
            except PatchError as e:
                raise ToolInputError(f"patch not applied (no file changed): {e}") from None
            writes[p.path] = result
            verb = "created" if p.old_path is None else "modified"
            summary.append(f"{verb} {p.path} ({len(p.hunks)} hunk(s))"
                           + "".join(f"; {n}" for n in notes))
        for path, text in writes.items():
            await sandbox.put_file(path, text.encode())
        for path in deletes:
            await sandbox.exec(["rm", "-f", "--", path], timeout_s=10)
        return ToolResult(output="applied patch: " + ", ".join(summary))

"""A trajectory's final work tree, read from its sandbox before the sandbox closes.

    capture = WorkTreeCapture()
    async with open_episode(suite, task, pool) as episode:
        ...                                   # the agent loop, the reward
        await capture.take(episode)           # still inside: the sandbox is up
    capture.diff(16_384)                      # what a judge's $diff shows

What the judges of a rubric may want of a code task after its sandbox is gone: the
change the agent made (`WorkTree.diff`, a unified diff against the task's initial
files) and the files as it left them (`WorkTree.files`: an agentic judge gets a
copy in a sandbox of its own).

- The base is the suite's `Suite.initial_files` (``swe``: the buggy repo; ``code``:
  nothing, the agent writes ``solution.py``); a suite that returns None has no work
  tree, and nothing is read.
- The files are listed with ``find`` in the sandbox's work dir, leaving out the
  graders' scratch (``.grade-*``) and ``__pycache__``; where listing fails, the
  initial files' paths are read (new files are then not seen: `WorkTree.notes`
  says so).
- Bounds: at most `max_files` files, each at most `max_file_bytes`; a file past
  either, or not UTF-8 text, is named in the diff as not shown and left out of
  `files`. `WorkTree.diff(max_chars)` ends with a marker line
  ``[diff truncated: N of M characters shown]`` when it is cut.
- Reading never fails the trajectory: a sandbox error leaves `WorkTreeCapture.tree`
  None and `error` the reason, and the diff a judge sees says the work tree could
  not be read.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

from treadle.envs.base import Episode
from treadle.errors import SandboxFileError, SandboxFileTooLarge, SandboxPathError, TreadleError
from treadle.sandbox.base import Sandbox

MAX_FILES = 256  # files read from one work tree
MAX_FILE_BYTES = 256 * 1024  # the largest file read
_FIND = ["find", ".", "(", "-path", "./.grade-*", "-o", "-name", "__pycache__", ")",
         "-prune", "-o", "-type", "f", "-print0"]


@dataclass(frozen=True, slots=True)
class WorkTree:
    """The files an agent left, beside the task's initial ones (module docstring)."""

    initial: Mapping[str, str]  # path -> text the task started with
    files: dict[str, str]  # path -> text at the end, for the files read
    not_shown: dict[str, str] = field(default_factory=dict)  # path -> why not read
    notes: tuple[str, ...] = ()  # what the capture could not do (e.g. no listing)

    def diff(self, max_chars: int) -> str:
        """A unified diff of the work tree against the initial files (added files
        from /dev/null, deleted ones to it), files in path order, cut at `max_chars`
        with a marker line (module docstring); "" when nothing changed."""
        parts: list[str] = [f"[{note}]\n" for note in self.notes]
        for path in sorted(set(self.initial) | set(self.files) | set(self.not_shown)):
            if path in self.not_shown:
                parts.append(f"[{path}: not shown ({self.not_shown[path]})]\n")
                continue
            before, after = self.initial.get(path), self.files.get(path)
            if before == after:
                continue
            parts.append("".join(difflib.unified_diff(
                (before or "").splitlines(keepends=True),
                (after or "").splitlines(keepends=True),
                fromfile="/dev/null" if before is None else f"a/{path}",
                tofile="/dev/null" if after is None else f"b/{path}")))
            if parts[-1] and not parts[-1].endswith("\n"):
                parts[-1] += "\n\\ No newline at end of file\n"
        return truncated("".join(parts), max_chars)


def truncated(text: str, max_chars: int) -> str:
    """`text`, or its first characters and a marker saying how many were shown."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[diff truncated: {max_chars} of {len(text)} characters shown]\n"


async def read_work_tree(sandbox: Sandbox, initial: Mapping[str, str], *,
                         max_files: int = MAX_FILES,
                         max_file_bytes: int = MAX_FILE_BYTES) -> WorkTree:
    """The sandbox's work tree against `initial` (module docstring). Raises the
    sandbox's errors (a closed sandbox, a failed exec)."""
    notes: list[str] = []
    listing = await sandbox.exec(_FIND, timeout_s=30.0)
    if listing.ok and not listing.truncated:
        paths = sorted(p.removeprefix("./") for p in listing.stdout.split("\0") if p)
    else:
        why = listing.killed or f"exit {listing.exit_code}"
        notes.append(f"the work tree could not be listed ({why}); files the agent added "
                     "are not shown")
        paths = sorted(initial)
    files: dict[str, str] = {}
    not_shown: dict[str, str] = {}
    for index, path in enumerate(paths):
        if index >= max_files:
            notes.append(f"{len(paths) - max_files} files past the first {max_files} "
                         "are not shown")
            # Not read is not deleted: the task's own files past the bound are named.
            not_shown.update({p: f"past the first {max_files} files"
                              for p in paths[index:] if p in initial})
            break
        try:
            data = await sandbox.get_file(path, max_bytes=max_file_bytes)
        except SandboxFileTooLarge:
            not_shown[path] = f"over {max_file_bytes} bytes"
            continue
        except (SandboxFileError, SandboxPathError) as e:
            if path not in initial:  # an initial file that is gone was deleted
                not_shown[path] = f"unreadable: {type(e).__name__}"
            continue
        try:
            files[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            not_shown[path] = "not UTF-8 text"
    return WorkTree(dict(initial), files, not_shown, tuple(notes))


class WorkTreeCapture:
    """Reads an episode's work tree once, before its sandbox closes (module
    docstring); `tree` after `take`, or None with `error` saying why."""

    def __init__(self, *, max_files: int = MAX_FILES,
                 max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self.max_files = max_files
        self.max_file_bytes = max_file_bytes
        self.tree: WorkTree | None = None
        self.error: str | None = None  # why there is no tree where the suite has one

    async def take(self, episode: Episode) -> None:
        initial = episode.suite.initial_files(episode.task)
        sandbox = episode.ctx.sandbox
        if initial is None:
            return  # the suite has no work tree
        if sandbox is None:
            self.error = "the episode had no sandbox"
            return
        try:
            self.tree = await read_work_tree(sandbox, initial, max_files=self.max_files,
                                             max_file_bytes=self.max_file_bytes)
        except TreadleError as e:
            self.error = f"{type(e).__name__}: {e}"

    def diff(self, max_chars: int) -> str:
        """The diff a judge's $diff shows: the tree's, a line saying why there is
        none, or "" for a suite without a work tree."""
        if self.tree is not None:
            return self.tree.diff(max_chars)
        if self.error is not None:
            return truncated(f"[the work tree could not be read: {self.error}]\n", max_chars)
        return ""


__all__ = ["WorkTree", "WorkTreeCapture", "read_work_tree", "truncated"]

"""`swe`: fix a seeded bug in a small Python repository; reward = its test suite passes.

The bundle (``data/swe``) holds 28 tiny packages (text utilities, a ledger, grid
search, a calendar, a CSV reader, statistics, geometry, an LRU cache, an
expression evaluator, semantic versions, matrices, an inventory, roman numerals,
intervals, a Markdown stripper, rate limiters, a priority queue, unit conversion,
a trie, run-length coding, word counts, a state machine, a topological sort, a
ring buffer, money rounding, durations, check digits, cron schedules), each with a
``unittest`` suite, and ``bugs.json``: 85 one-to-few-line mutations, each with an
issue text written as a user's bug report. A task is one package with one bug applied.
The tests need nothing but the standard library (``python3 -m unittest`` runs them).

Episode: `setup` writes a fresh copy of the buggy repo into the sandbox work dir;
the agent reads, edits (`read_file`, `write_file`, `apply_patch`) and runs code
(`bash`, `python`), then calls `submit_answer`.

Grading, in the same sandbox: the repo's files as the agent left them are copied
into a fresh ``.grade-<random>/`` directory, except the test files, which are
restored from the task (editing or deleting tests earns nothing); files the agent
added are not copied (a planted ``unittest.py`` never reaches the grader). A
harness run with ``python3 -I`` (no PYTHON* variables, no user site) discovers and
runs the tests and prints a summary behind a random nonce it read from stdin
before any repo code ran. Reward 1.0 iff at least one test ran and none failed or
errored; a repo whose code exits the process early prints no summary, and one
that patches ``unittest``'s classes while the tests run is caught: both score 0.0.

Limits of the grader: the repo's code runs in the interpreter that runs its
tests, so a determined reward hack (patching assertion helpers of the test
modules, or finding the nonce by frame inspection) is not excluded; it catches
honest failures and the simple hacks above, not an adversary.

Task format::

    {"id": "bug-1", "issue": "slugify() leaves dashes ...",
     "files": {"pkg/core.py": "...", "tests/__init__.py": "", "tests/test_core.py": "..."},
     "tests_dir": "tests", "pattern": "test*.py", "solution_patch": "--- a/pkg/core.py ..."}

``issue`` (shown to the model) and ``files`` (path -> text, the buggy repo) are
required. ``tests_dir`` (default "tests"; every file under it is restored before
grading; it needs an ``__init__.py``), ``pattern`` (discovery pattern, default
"test*.py") and ``solution_patch`` (a reference fix, never shown) are optional.
Limits: only ``unittest`` suites; the repo must be importable from its root.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import secrets
from collections.abc import Mapping
from importlib import resources
from typing import Any

from treadle.envs.base import RewardResult, Suite
from treadle.envs.errors import TaskFormatError
from treadle.envs.records import check_keys, opt_str, req_dict, req_str, rng_for
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool, ToolContext
from treadle.envs.tools.exec import BashTool, PythonTool
from treadle.envs.tools.files import ReadFileTool, WriteFileTool
from treadle.envs.tools.patch import ApplyPatchTool
from treadle.errors import SandboxFileError, SandboxPathError
from treadle.sandbox.base import Limits
from treadle.types import Task

_FILE_MARK = re.compile(r"^#### FILE (\S+)\n", re.MULTILINE)
PROMPT = (
    "You are working in a small Python repository (the current directory). A user reported "
    "this bug:\n\n{issue}\n\nFind the cause and fix it in the package's source code. Use "
    "`bash` (e.g. `ls -R`, `python3 -m unittest`), `read_file`, `write_file` and "
    "`apply_patch`. Do not change the tests: they are restored before grading. The task is "
    "solved when the whole test suite passes. When you are done, call `submit_answer` with a "
    "one-line summary of the fix.")
HARNESS = r'''
import io, json, os, sys, unittest

WATCHED = (unittest.TestCase, unittest.TestSuite, unittest.TestResult, unittest.TextTestResult,
           unittest.TextTestRunner, unittest.TestLoader)

def main():
    spec = json.loads(sys.stdin.read())
    nonce = spec["nonce"]
    out, dumps = sys.stdout, json.dumps
    before = [dict(vars(cls)) for cls in WATCHED]
    root = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, root)  # as `python3 -m unittest` run in the repo would have it
    os.chdir(root)
    stream = io.StringIO()
    try:
        suite = unittest.defaultTestLoader.discover(
            os.path.join(root, spec["tests_dir"]), pattern=spec["pattern"], top_level_dir=root)
        result = unittest.TextTestRunner(stream=stream, verbosity=1).run(suite)
    except BaseException as e:
        out.write(stream.getvalue()[-3000:] + "\n")
        out.write(nonce + dumps({"crash": type(e).__name__ + ": " + str(e)[:300]}) + "\n")
        return
    out.write(stream.getvalue()[-3000:] + "\n")
    changed = [cls.__name__ for cls, old in zip(WATCHED, before) if dict(vars(cls)) != old]
    if changed:  # the repo's code patched the test framework while it ran
        out.write(nonce + dumps({"crash": "unittest was modified: " + ", ".join(changed)}) + "\n")
        return
    out.write(nonce + dumps({
        "run": result.testsRun, "failures": len(result.failures), "errors": len(result.errors),
        "unexpected": len(result.unexpectedSuccesses)}) + "\n")
    out.flush()

main()
'''


def split_bundle(text: str) -> dict[str, str]:
    """path -> content of a ``#### FILE path`` bundle file."""
    parts = _FILE_MARK.split(text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


@functools.cache
def _bundle() -> tuple[dict[str, dict[str, str]], list[dict[str, str]]]:
    root = resources.files("treadle.envs").joinpath("data").joinpath("swe")
    repos = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            repos[entry.name.removesuffix(".txt")] = split_bundle(entry.read_text("utf-8"))
    bugs = json.loads(root.joinpath("bugs.json").read_text("utf-8"))
    return repos, bugs


def unified_diff(path: str, before: str, after: str) -> str:
    """A git-style unified diff of one file."""
    return "".join(difflib.unified_diff(before.splitlines(keepends=True),
                                        after.splitlines(keepends=True),
                                        fromfile=f"a/{path}", tofile=f"b/{path}"))


def bundled_records() -> list[dict[str, Any]]:
    """Every bundled task as a record (the buggy repo plus the reference patch)."""
    repos, bugs = _bundle()
    records = []
    for bug in bugs:
        files = dict(repos[bug["repo"]])
        fixed = files[bug["file"]]
        if fixed.count(bug["find"]) != 1:
            raise ValueError(f"bug {bug['repo']}/{bug['bug']}: 'find' must occur exactly once")
        files[bug["file"]] = fixed.replace(bug["find"], bug["replace"])
        records.append({"id": f"swe-{bug['repo']}-{bug['bug']}", "issue": bug["issue"],
                        "files": files, "solution_patch": unified_diff(
                            bug["file"], files[bug["file"]], fixed)})
    return records


def repo_tools(timeout_s: float) -> list[Tool]:
    """What an agent fixing a repository gets: a shell, files, patches, python and an
    answer (the bundled swe suite's and swe-images')."""
    return [BashTool(timeout_s=timeout_s), ReadFileTool(), WriteFileTool(), ApplyPatchTool(),
            PythonTool(timeout_s=timeout_s), SubmitAnswerTool("a one-line summary of the fix")]


class SweSuite(Suite):
    """Bug-fixing in small repositories; see the module docstring."""

    name = "swe"
    limits = Limits(cpu_s=20, memory_mb=512, wall_timeout_s=60)

    def __init__(self, *, tool_timeout_s: float = 30.0, grade_timeout_s: float = 60.0) -> None:
        self.tool_timeout_s = tool_timeout_s
        self.grade_timeout_s = grade_timeout_s

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` of the 85 bundled tasks (None: all) in a seeded order."""
        records = bundled_records()
        rng_for(self.name, seed).shuffle(records)
        if n is not None and not 0 <= n <= len(records):
            raise ValueError(f"n must be between 0 and {len(records)}, got {n}")
        return [self.task_from_record(r) for r in records[:n]]

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        check_keys(record, {"issue", "files", "tests_dir", "pattern", "solution_patch"})
        task_id, issue = req_str(record, "id"), req_str(record, "issue")
        files = req_dict(record, "files")
        if not files or not all(isinstance(p, str) and isinstance(c, str)
                                for p, c in files.items()):
            raise TaskFormatError("field 'files' must map paths to file contents (strings)")
        for path in files:
            if path.startswith("/") or ".." in path.split("/") or not path.strip("/"):
                raise TaskFormatError(f"field 'files': {path!r} must be a relative path "
                                      "inside the repo")
        tests_dir = (opt_str(record, "tests_dir", "tests") or "tests").strip("/")
        if not any(p.startswith(tests_dir + "/") for p in files):
            raise TaskFormatError(f"no files under tests_dir {tests_dir!r}")
        metadata: dict[str, Any] = {"issue": issue, "files": dict(files)}
        for key in ("tests_dir", "pattern", "solution_patch"):
            value = opt_str(record, key)
            if value is not None:
                metadata[key] = value
        return self._task(task_id, PROMPT.format(issue=issue), metadata)

    def initial_files(self, task: Task) -> Mapping[str, str]:
        """The buggy repo, as `setup` writes it."""
        files: Mapping[str, str] = task.metadata["files"]
        return files

    def tools(self, task: Task) -> list[Tool]:
        return repo_tools(self.tool_timeout_s)

    async def setup(self, ctx: ToolContext) -> str | None:
        sandbox = ctx.require_sandbox()
        for path, content in sorted(ctx.task.metadata["files"].items()):
            await sandbox.put_file(path, content.encode())
        return None

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        sandbox = ctx.require_sandbox()
        meta = ctx.task.metadata
        tests_dir = meta.get("tests_dir", "tests").strip("/")
        grade = f".grade-{secrets.token_hex(6)}"
        for path, original in sorted(meta["files"].items()):
            content: bytes | None = original.encode()
            if not path.startswith(tests_dir + "/"):
                try:
                    content = await sandbox.get_file(path)
                except (SandboxFileError, SandboxPathError):
                    content = None  # the agent deleted it (or replaced it by a link)
            if content is not None:
                await sandbox.put_file(f"{grade}/{path}", content)
        await sandbox.put_file(f"{grade}/_treadle_grade.py", HARNESS.encode())
        nonce = f"@@{secrets.token_hex(8)}@@"
        spec = {"nonce": nonce, "tests_dir": tests_dir, "pattern": meta.get("pattern", "test*.py")}
        result = await sandbox.exec(["python3", "-I", f"{grade}/_treadle_grade.py"],
                                    timeout_s=self.grade_timeout_s,
                                    stdin=json.dumps(spec).encode())
        summary: dict[str, Any] | None = None
        for line in result.stdout.splitlines():
            if line.startswith(nonce):
                try:
                    summary = json.loads(line[len(nonce):])
                except json.JSONDecodeError:
                    summary = None
        if summary is None or "run" not in summary:
            why = (summary or {}).get("crash") or result.killed or f"exit {result.exit_code}"
            return RewardResult(0.0, {"tests_run": 0.0, "passed": 0.0},
                                f"the test suite did not complete ({why})")
        bad = int(summary["failures"]) + int(summary["errors"]) + int(summary["unexpected"])
        run = int(summary["run"])
        ok = run > 0 and bad == 0
        return RewardResult(float(ok), {"tests_run": float(run), "passed": float(run - bad)},
                            f"{run - bad}/{run} tests passed")

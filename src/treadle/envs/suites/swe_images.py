"""`swe-images`: SWE-bench-style tasks, each in its own environment image.

``get_suite("swe-images", instances="data.jsonl")`` loads instances in the format of
`treadle.envs.suites.swe_instances`; without ``instances`` the suite offers the
built-in ones (`treadle.envs.suites.swe_builtin`: real PyPI projects with a real
bug put back, images built here on first use).

Episode: the sandbox runs on the instance's image (`Suite.sandbox_backend`: a
bwrap backend is given the instance's image; a pool must be over that backend,
which the service's `SuitePools` does); its
work dir is the image's working dir, a private copy of the repository at
``base_commit``. Setup reads the repository's own versions of the test files
(every file the ``test_patch`` touches, and every file a named test lives in)
before the agent acts. The agent reads, edits and runs code (`bash`, `python`,
`read_file`, `write_file`, `apply_patch`), then calls `submit_answer`.

Grading, in the same sandbox after the agent's edits: those test files are put
back as they were, the ``test_patch`` applied to them (on the host: the image
needs no `patch` or `git`), then ``<test_cmd> -rA -p no:cacheprovider <ids>``
runs the FAIL_TO_PASS and PASS_TO_PASS tests in the work dir, and each test's
outcome is read from pytest's short summary (`_pytest_report`). **Resolved**
(reward 1.0) iff every FAIL_TO_PASS test passes and every PASS_TO_PASS test
passes (a test that is missing from the report, e.g. not collected, counts as not
passing). Metrics: ``resolved``, ``fail_to_pass_passed``/``_total``,
``pass_to_pass_passed``/``_total``, and one entry per test, ``"F2P <id>"`` or
``"P2P <id>"``, 1.0 if it passed, else 0.0 (stored in the trajectory record);
``detail`` names the tests that did not pass and how.

Limits: ``test_cmd`` must be a pytest command line; test files the test_patch
does not touch and no named test lives in (a ``conftest.py``) are graded as the
agent left them; code under test runs in pytest's process and can forge its
report (see `_pytest_report`): honest failures are caught, not an adversary.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from treadle.envs.base import RewardResult, Suite
from treadle.envs.errors import EnvConfigError, TaskFormatError
from treadle.envs.records import read_jsonl, rng_for
from treadle.envs.suites._pytest_report import Outcome, outcomes
from treadle.envs.suites.swe import repo_tools
from treadle.envs.suites.swe_instances import SweInstance, parse_instance
from treadle.envs.tools.base import Tool, ToolContext
from treadle.envs.tools.patch import (
    PatchError,
    apply_hunks,
    parse_unified_diff,
)
from treadle.errors import SandboxFileError, SandboxPathError, SandboxUnsupported
from treadle.sandbox.base import Limits, SandboxBackend
from treadle.types import Task

PROMPT = (
    "You are working in a checkout of the repository {repo} (the current directory, "
    "{workdir}). A user opened this issue:\n\n{issue}\n\nFind the cause and fix it in the "
    "repository's source code. Use `bash` (e.g. `ls`, `grep -rn`, `python3 -m pytest -x -q`), "
    "`read_file`, `write_file` and `apply_patch`. Do not edit the existing tests: they are "
    "restored before grading, when the maintainers' tests for this issue are run. When you are "
    "done, call `submit_answer` with a one-line summary of the fix.")
_STATE = "swe_images_originals"
_PYTEST_ARGS = "-rA -p no:cacheprovider"


def instance_of(task: Task) -> SweInstance:
    return SweInstance.model_validate(task.metadata)


def _graded_files(instance: SweInstance) -> list[str]:
    """Every file the test_patch touches and every file a named test lives in."""
    paths: set[str] = set()
    if instance.test_patch.strip():
        for patch in parse_unified_diff(instance.test_patch):
            paths.update(p for p in (patch.old_path, patch.new_path) if p is not None)
    for test in (*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS):
        paths.add(test.split("::", 1)[0])
    for path in paths:
        if path.startswith("/") or ".." in path.split("/") or not path.strip("/"):
            raise PatchError(f"{path!r} is not a path inside the repository")
    return sorted(paths)


def patched_tests(instance: SweInstance, originals: Mapping[str, bytes | None]
                  ) -> dict[str, bytes | None]:
    """The graded files as the grader runs them (None: absent): the repository's version
    with the test_patch applied. EnvConfigError if the test_patch does not apply."""
    files = dict(originals)
    if not instance.test_patch.strip():
        return files
    for patch in parse_unified_diff(instance.test_patch):
        if patch.new_path is None:
            files[patch.path] = None
            continue
        before = files.get(patch.old_path) if patch.old_path is not None else None
        try:
            text, _ = apply_hunks((before or b"").decode("utf-8"), patch.hunks, patch.path)
        except (PatchError, UnicodeDecodeError) as e:
            raise EnvConfigError(f"instance {instance.instance_id}: the test_patch does not "
                                 f"apply to the image's repository: {e}") from None
        if patch.old_path is not None and patch.old_path != patch.new_path:
            files[patch.old_path] = None
        files[patch.new_path] = text.encode()
    return files


class SweImageSuite(Suite):
    """SWE-bench-style tasks in their images; see the module docstring."""

    name = "swe-images"
    file_options = ("instances",)
    limits = Limits(cpu_s=120, memory_mb=1024, wall_timeout_s=300)

    def __init__(self, instances: str | None = None, *, tool_timeout_s: float = 60.0,
                 grade_timeout_s: float = 300.0, images_kept: int = 32) -> None:
        if images_kept < 1:
            raise ValueError(f"images_kept must be >= 1, got {images_kept}")
        self.images_kept = images_kept
        self.instances = instances
        self.tool_timeout_s = tool_timeout_s
        self.grade_timeout_s = grade_timeout_s
        # (id of the caller's backend, image) -> (that backend, ours on the image), most
        # recently used last: each holds its image in use (not evictable) while it lives.
        self._backends: collections.OrderedDict[
            tuple[int, str], tuple[SandboxBackend, SandboxBackend]] = collections.OrderedDict()
        self._builtin_images: set[str] = set()
        # Read now: the service hands a file it holds open only while the suite is built.
        self._loaded = None if instances is None else self.load_tasks(instances)

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` instances (None: all) in a seeded order: the file's (read when the suite
        was made), or the built-in ones (whose images are built on first use)."""
        if self._loaded is not None:
            tasks = list(self._loaded)
        else:
            from treadle.envs.suites.swe_builtin import builtin_records
            tasks = [self.task_from_record(r) for r in builtin_records()]
            self._builtin_images.update(t.metadata["image"] for t in tasks)
        rng_for(self.name, seed).shuffle(tasks)
        if n is not None and not 0 <= n <= len(tasks):
            raise ValueError(f"n must be between 0 and {len(tasks)}, got {n}")
        return tasks[:n]

    def load_tasks(self, path: str | Path) -> list[Task]:
        """Instances from JSONL; a relative ``image`` is relative to the file's directory.
        TaskFormatError naming the file, the line and the field."""
        tasks: list[Task] = []
        seen: set[str] = set()
        for number, record in read_jsonl(path):
            image = record.get("image")
            if isinstance(image, str) and image and not Path(image).is_absolute():
                record = {**record, "image": str(Path(path).resolve().parent / image)}
            try:
                task = self.task_from_record(record)
            except TaskFormatError as e:
                raise TaskFormatError(f"{path}:{number}: {e}") from None
            if task.task_id in seen:
                raise TaskFormatError(f"{path}:{number}: duplicate instance_id "
                                      f"{task.task_id!r}")
            seen.add(task.task_id)
            tasks.append(task)
        return tasks

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        instance = parse_instance(record)
        try:
            _graded_files(instance)
        except PatchError as e:
            raise TaskFormatError(f"field 'test_patch' or a test id: {e}") from None
        prompt = PROMPT.format(repo=instance.repo, workdir=instance.workdir or "the work dir",
                               issue=instance.problem_statement)
        return self._task(instance.instance_id, prompt, instance.record())

    def task_to_record(self, task: Task) -> dict[str, Any]:
        return dict(task.metadata)

    def host_paths(self, task: Task) -> tuple[str, ...]:
        """The task's image, unless it is a built-in one (which treadle built)."""
        image = task.metadata["image"]
        return () if image in self._builtin_images else (image,)

    def sandbox_backend(self, task: Task, backend: SandboxBackend) -> SandboxBackend:
        """A backend like `backend` on the instance's image (bwrap; remote, where the
        servers run the image: `--images`); the last `images_kept` are kept (an image is
        then opened once, and stays in use, not evictable)."""
        image = task.metadata["image"]
        if backend.image == image:
            return backend
        key = (id(backend), image)
        if key in self._backends:
            self._backends.move_to_end(key)
        else:
            try:
                on_image = backend.with_image(image)
            except SandboxUnsupported as e:
                raise EnvConfigError(f"suite {self.name!r} runs each task in its image: {e}") \
                    from None
            self._backends[key] = (backend, on_image)
            while len(self._backends) > self.images_kept:
                self._backends.popitem(last=False)  # its image is released once unused
        return self._backends[key][1]

    def tools(self, task: Task) -> list[Tool]:
        return repo_tools(self.tool_timeout_s)

    async def setup(self, ctx: ToolContext) -> str | None:
        sandbox = ctx.require_sandbox()
        instance = instance_of(ctx.task)
        if instance.workdir is not None and sandbox.workdir != instance.workdir:
            raise EnvConfigError(f"instance {instance.instance_id}: its image's work dir is "
                                 f"{sandbox.workdir}, the instance says {instance.workdir}")
        originals: dict[str, bytes | None] = {}
        for path in _graded_files(instance):
            try:
                originals[path] = await sandbox.get_file(path)
            except (SandboxFileError, SandboxPathError):
                originals[path] = None
        ctx.state[_STATE] = originals
        return None

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        sandbox = ctx.require_sandbox()
        instance = instance_of(ctx.task)
        restored = patched_tests(instance, ctx.state[_STATE])
        # Whatever the agent left at these paths (a directory, a link) goes first.
        removed = await sandbox.exec(["rm", "-rf", "--", *restored], timeout_s=60)
        for path, content in restored.items():
            try:
                if not removed.ok:
                    raise SandboxFileError(removed.stderr.strip()[-300:])
                if content is not None:
                    await sandbox.put_file(path, content)
            except (SandboxFileError, SandboxPathError) as e:  # e.g. a link on the way
                return RewardResult(0.0, {"resolved": 0.0},
                                    f"could not restore the test file {path}: {e}")
        tests = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
        # The ids as arguments of their own, not in the command string: SWE-bench's
        # lists run to thousands of ids, past the kernel's 128 KiB for one argument.
        command = f'{instance.command} {_PYTEST_ARGS} "$@"'
        result = await sandbox.exec(["/bin/sh", "-c", command, "sh", *tests],
                                    timeout_s=self.grade_timeout_s,
                                    env={"PYTHONDONTWRITEBYTECODE": "1"})
        found = outcomes(result.stdout, tests)
        graded = _grade(instance, found, result.killed)
        if all(o is Outcome.MISSING for o in found.values()):  # e.g. "ERROR: not found: id"
            why = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or [""]
            graded = RewardResult(graded.reward, graded.metrics,
                                  f"{graded.detail}; pytest (exit {result.exit_code}): "
                                  f"{why[0][:300]}")
        return graded


def _grade(instance: SweInstance, found: Mapping[str, Outcome], killed: str | None
           ) -> RewardResult:
    f2p = [found[t].ok for t in instance.FAIL_TO_PASS]
    p2p = [found[t].ok for t in instance.PASS_TO_PASS]
    resolved = all(f2p) and all(p2p)
    metrics = {"resolved": float(resolved),
               "fail_to_pass_passed": float(sum(f2p)), "fail_to_pass_total": float(len(f2p)),
               "pass_to_pass_passed": float(sum(p2p)), "pass_to_pass_total": float(len(p2p))}
    for prefix, ids in (("F2P", instance.FAIL_TO_PASS), ("P2P", instance.PASS_TO_PASS)):
        for test in ids:
            metrics[f"{prefix} {test}"] = float(found[test].ok)
    bad = [f"{t} {o.value}" for t, o in found.items() if not o.ok]
    detail = (f"{'resolved' if resolved else 'unresolved'}: FAIL_TO_PASS {sum(f2p)}/{len(f2p)}, "
              f"PASS_TO_PASS {sum(p2p)}/{len(p2p)}")
    if killed:
        detail += f"; the test run was killed ({killed})"
    if bad:
        detail += "; not passing: " + ", ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")
    return RewardResult(float(resolved), metrics, detail)


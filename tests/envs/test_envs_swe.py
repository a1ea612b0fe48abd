"""The swe suite: the bundle, the task format, and fixing bugs in a real sandbox."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from envs_helpers import Backend, play, run

from treadle.envs import TaskFormatError, get_suite
from treadle.envs.suites.swe import SweSuite, _bundle, bundled_records
from treadle.envs.tools.patch import apply_hunks, parse_unified_diff

SUITE = SweSuite()
# Runs every bundled repo's tests in one process, fixed and buggy: unittest in-process is
# ~100x faster than a process per run. Prints {"id:variant": [tests run, problems]}.
CHECKER = r'''
import io, json, os, sys, tempfile, unittest
out = {}
for rec in json.load(sys.stdin):
    for variant, files in (("fixed", rec["fixed"]), ("buggy", rec["files"])):
        with tempfile.TemporaryDirectory() as root:
            for path, text in files.items():
                os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
                with open(os.path.join(root, path), "w") as f:
                    f.write(text)
            top = {p.split("/")[0] for p in files}
            for name in list(sys.modules):
                if name.split(".")[0] in top:
                    del sys.modules[name]
            sys.path.insert(0, root)
            suite = unittest.defaultTestLoader.discover(os.path.join(root, "tests"),
                                                         top_level_dir=root)
            result = unittest.TextTestRunner(stream=io.StringIO()).run(suite)
            sys.path.remove(root)
            out[rec["id"] + ":" + variant] = [result.testsRun,
                                              len(result.failures) + len(result.errors)]
print(json.dumps(out))
'''


def test_bundle_is_small_and_has_enough_distinct_tasks() -> None:
    root = resources.files("treadle.envs").joinpath("data").joinpath("swe")
    size = sum(len(entry.read_bytes()) for entry in root.iterdir())
    assert size < 300 * 1024, f"bundle is {size} bytes"
    repos, bugs = _bundle()
    assert len(repos) >= 10 and len(bugs) >= 24
    assert len({(b["repo"], b["bug"]) for b in bugs}) == len(bugs)
    for bug in bugs:
        assert repos[bug["repo"]][bug["file"]].count(bug["find"]) == 1, bug
        assert bug["find"] != bug["replace"] and len(bug["issue"]) > 30, bug
    tasks = SUITE.tasks()
    assert len(tasks) == len(bugs) and len({t.task_id for t in tasks}) == len(bugs)


def test_every_repo_is_a_small_stdlib_package_with_its_own_bugs() -> None:
    repos, bugs = _bundle()
    assert len(repos) >= 26 and len(bugs) >= 75, (len(repos), len(bugs))
    per_repo = Counter(bug["repo"] for bug in bugs)
    # Every repo has a bug, so the run below checks every repo's clean suite too.
    assert set(per_repo) == set(repos) and max(per_repo.values()) <= 4, per_repo
    for name, files in repos.items():
        code = {p: text for p, text in files.items() if not p.startswith("tests/")}
        assert all(p.startswith(name + "/") and p.endswith(".py") for p in code), name
        assert f"{name}/__init__.py" in code and "tests/__init__.py" in files, name
        assert any(p.startswith("tests/test_") for p in files), name
        lines = sum(1 for text in code.values() for line in text.splitlines() if line.strip())
        assert 25 <= lines <= 150, (name, lines)
        for path, text in files.items():  # only the standard library and the repo itself
            for node in ast.walk(ast.parse(text, path)):
                if isinstance(node, ast.Import):
                    roots = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    roots = [node.module.split(".")[0]]
                else:
                    continue
                for root in roots:
                    assert root in (name, "tests") or root in sys.stdlib_module_names, (path, root)
    for bug in bugs:
        assert not bug["file"].startswith("tests/"), bug
        assert bug["find"].strip() not in bug["issue"], bug  # the issue must not quote the fix


def test_every_bug_breaks_its_tests_and_every_reference_patch_fixes_them() -> None:
    repos, bugs = _bundle()
    records = bundled_records()
    payload = []
    for record, bug in zip(records, bugs, strict=True):
        fixed = repos[bug["repo"]]
        [patch] = parse_unified_diff(record["solution_patch"])
        patched, _ = apply_hunks(record["files"][patch.path], patch.hunks)
        assert patched == fixed[patch.path], record["id"]
        payload.append({"id": record["id"], "files": record["files"], "fixed": fixed})
    proc = subprocess.run([sys.executable, "-I", "-c", CHECKER], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=120, check=True)
    results = json.loads(proc.stdout)
    for record in records:
        run_fixed, bad_fixed = results[record["id"] + ":fixed"]
        _, bad_buggy = results[record["id"] + ":buggy"]
        assert run_fixed >= 5 and bad_fixed == 0, (record["id"], run_fixed, bad_fixed)
        assert bad_buggy > 0, f"{record['id']}: the seeded bug breaks no test"


def test_task_format(tmp_path: Path) -> None:
    record: dict[str, Any] = {
        "id": "mini", "issue": "inc() adds two instead of one, so counts are off.",
        "files": {"mini/__init__.py": "def inc(x):\n    return x + 2\n",
                  "tests/__init__.py": "",
                  "tests/test_mini.py": "import unittest\nfrom mini import inc\n\n"
                                        "class T(unittest.TestCase):\n"
                                        "    def test(self):\n"
                                        "        self.assertEqual(inc(1), 2)\n"}}
    path = tmp_path / "swe.jsonl"
    path.write_text(json.dumps(record) + "\n")
    [task] = SUITE.load_tasks(path)
    assert record["issue"] in str(task.prompt) and SUITE.task_to_record(task) == record
    for broken, fragment in (({"files": {}}, "files"),
                             ({"files": {"../x.py": "", "tests/t.py": ""}}, "relative"),
                             ({"files": {"a.py": ""}}, "tests_dir"),
                             ({"issue": 3}, "issue")):
        with pytest.raises(TaskFormatError, match=fragment):
            SUITE.task_from_record({**record, **broken})


@pytest.mark.integration
def test_swe_end_to_end_fix_with_tools(sandbox_backend: Backend) -> None:
    suite = get_suite("swe")
    for task in suite.tasks(2, seed=1):
        patch = task.metadata["solution_patch"]
        path = parse_unified_diff(patch)[0].path
        good, results = run(play(suite, task, sandbox_backend.backend, [
            ("bash", {"command": "python3 -m unittest 2>&1 | tail -1"}),
            ("read_file", {"path": path}),
            ("apply_patch", {"patch": patch}),
            ("bash", {"command": "python3 -m unittest 2>&1 | tail -1"}),
            ("submit_answer", {"answer": "fixed"})]))
        assert "FAILED" in results[0].output, (sandbox_backend.label(), results[0])
        assert results[2].ok and results[3].output.strip() == "OK", (sandbox_backend.label(),
                                                                     results[2:4])
        assert good.reward == 1.0, (sandbox_backend.label(), task.task_id, good)
        bad, _ = run(play(suite, task, sandbox_backend.backend,
                          [("submit_answer", {"answer": "could not find it"})]))
        assert bad.reward == 0.0 and bad.metrics["tests_run"] > 0, (sandbox_backend.label(), bad)


@pytest.mark.integration
def test_editing_tests_or_exiting_early_earns_nothing(sandbox_backend: Backend) -> None:
    task = next(t for t in SUITE.tasks() if t.task_id == "swe-ledger-total-kind")
    files = task.metadata["files"]
    test_path = next(p for p in files if p.startswith("tests/test_"))
    gutted = "import unittest\n\nclass T(unittest.TestCase):\n    def test(self):\n        pass\n"
    tricks = {
        "rewrite the tests": [("write_file", {"path": test_path, "content": gutted})],
        "delete the tests": [("bash", {"command": "rm -rf tests"})],
        "exit on import": [("write_file", {"path": "ledger/__init__.py",
                                           "content": "import os\nos._exit(0)\n"})],
        "shadow unittest": [("write_file", {"path": "unittest.py", "content": "raise SystemExit"}),
                            ("write_file", {"path": "tests/unittest.py", "content": ""})],
        "delete the package": [("bash", {"command": "rm -rf ledger"})],
        "stub the assertions": [("bash", {"command": (
            "printf 'import unittest\\nunittest.TestCase.assertEqual = "
            "lambda *a, **k: None\\n' >> ledger/__init__.py")})],
    }
    for name, calls in tricks.items():
        result, outputs = run(play(SUITE, task, sandbox_backend.backend, calls))
        assert all(o.ok for o in outputs), (name, outputs)
        assert result.reward == 0.0, (sandbox_backend.label(), name, result)


@pytest.mark.integration
def test_a_fix_by_rewriting_the_file_also_counts(sandbox_backend: Backend) -> None:
    repos, bugs = _bundle()
    task = next(t for t in SUITE.tasks() if t.task_id == "swe-semver-bump-minor")
    bug = next(b for b in bugs if b["repo"] == "semver" and b["bug"] == "bump-minor")
    fixed = repos["semver"][bug["file"]]
    result, _ = run(play(SUITE, task, sandbox_backend.backend, [
        ("write_file", {"path": bug["file"], "content": fixed}),
        ("write_file", {"path": "notes.txt", "content": "agent scratch file"})]))
    assert result.reward == 1.0, (sandbox_backend.label(), result)

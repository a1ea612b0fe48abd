"""A trajectory's work tree read from a real (bwrap) sandbox: the diff against the
task's files shows edits, new and deleted files, leaves the graders' scratch out,
names what it cannot show, and says where it is cut."""

from __future__ import annotations

from envs_helpers import TEST_LIMITS, Backend, run

from treadle.envs.registry import get_suite
from treadle.envs.suites.swe import unified_diff
from treadle.envs.worktree import WorkTree, WorkTreeCapture, read_work_tree
from treadle.sandbox.base import SandboxBackend

INITIAL = {"pkg/core.py": "def f():\n    return 1\n", "pkg/gone.py": "x = 1\n",
           "tests/test_core.py": "import pkg\n"}


async def left_by_an_agent(backend: SandboxBackend, **bounds: int) -> WorkTree:
    async with await backend.start(TEST_LIMITS) as sb:
        for path, text in INITIAL.items():
            await sb.put_file(path, text.encode())
        await sb.put_file("pkg/core.py", b"def f():\n    return 2\n")
        await sb.put_file("pkg/new.py", b"y = 2\n")
        await sb.put_file("blob.bin", b"\xff\xfe\x00")
        await sb.put_file(".grade-abc/_treadle_grade.py", b"grader\n")
        await sb.put_file("pkg/__pycache__/core.cpython-312.pyc", b"\x00")
        assert (await sb.exec(["rm", "pkg/gone.py"], timeout_s=10)).ok
        return await read_work_tree(sb, INITIAL, **bounds)


def test_the_diff_shows_what_the_agent_changed_and_nothing_of_the_grader(
        sandbox_backend: Backend) -> None:
    tree = run(left_by_an_agent(sandbox_backend.backend))
    assert tree.files == {"pkg/core.py": "def f():\n    return 2\n", "pkg/new.py": "y = 2\n",
                          "tests/test_core.py": "import pkg\n"}
    assert tree.not_shown == {"blob.bin": "not UTF-8 text"}
    assert tree.diff(10_000) == (
        "[blob.bin: not shown (not UTF-8 text)]\n"
        + unified_diff("pkg/core.py", INITIAL["pkg/core.py"], "def f():\n    return 2\n")
        + "--- a/pkg/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x = 1\n"
        + "--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1 @@\n+y = 2\n")
    cut = tree.diff(40)
    assert cut.startswith(tree.diff(10_000)[:40])
    assert cut.endswith(f"\n[diff truncated: 40 of {len(tree.diff(10_000))} characters "
                        "shown]\n")


def test_bounds_name_the_files_left_out(sandbox_backend: Backend) -> None:
    tree = run(left_by_an_agent(sandbox_backend.backend, max_files=2, max_file_bytes=8))
    # Files in path order: blob.bin (3 bytes, binary), pkg/core.py (over 8 bytes).
    # Past them, the task's own files are named, never shown as deleted.
    assert tree.not_shown == {"blob.bin": "not UTF-8 text", "pkg/core.py": "over 8 bytes",
                              "tests/test_core.py": "past the first 2 files"}
    assert "+++ /dev/null\n@@ -1 +0,0 @@\n-import pkg" not in tree.diff(10_000)
    assert tree.notes == ("2 files past the first 2 are not shown",)
    assert tree.diff(10_000).startswith("[2 files past the first 2 are not shown]\n")


def test_a_closed_sandbox_leaves_no_tree_and_says_why(sandbox_backend: Backend) -> None:
    suite = get_suite("swe")
    (task,) = suite.tasks(1, seed=0)

    async def after_close() -> WorkTreeCapture:
        sb = await sandbox_backend.backend.start(TEST_LIMITS)
        episode = suite.episode(task, sb)
        await sb.close()
        capture = WorkTreeCapture()
        await capture.take(episode)
        return capture

    capture = run(after_close())
    assert capture.tree is None and capture.error is not None
    assert capture.diff(10_000).startswith("[the work tree could not be read: Sandbox")

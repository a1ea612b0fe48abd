"""The tools: specs, argument checking, errors as observations, latency, sandbox use."""

from __future__ import annotations

from typing import Any

import pytest
from envs_helpers import TEST_LIMITS, Backend, run

from treadle.envs.errors import EnvConfigError
from treadle.envs.tools import (
    ApplyPatchTool,
    BashTool,
    Document,
    PythonTool,
    ReadFileTool,
    SearchTool,
    SubmitAnswerTool,
    Tool,
    ToolContext,
    WriteFileTool,
)
from treadle.errors import SandboxClosed
from treadle.sandbox import Limits
from treadle.types import Task

ALL_TOOLS: list[Tool] = [PythonTool(), BashTool(), ReadFileTool(), WriteFileTool(),
                         ApplyPatchTool(), SearchTool([Document("d1", "t", "x")]),
                         SubmitAnswerTool()]


def ctx(sandbox: Any = None) -> ToolContext:
    return ToolContext(task=Task(task_id="t", prompt="p"), sandbox=sandbox)


@pytest.mark.parametrize("tool", ALL_TOOLS, ids=lambda t: t.name)
def test_specs_are_function_calling_entries(tool: Tool) -> None:
    spec = tool.spec
    assert spec["type"] == "function"
    function = spec["function"]
    assert function["name"] == tool.name and function["description"]
    params = function["parameters"]
    assert params["type"] == "object" and params["additionalProperties"] is False
    assert set(params["required"]) <= set(params["properties"])


def test_tool_names_are_the_documented_ones() -> None:
    assert [t.name for t in ALL_TOOLS] == ["python", "bash", "read_file", "write_file",
                                           "apply_patch", "search", "submit_answer"]


@pytest.mark.parametrize(("arguments", "fragment"), [
    ({}, "missing required argument 'answer'"),
    ({"answer": 3}, "answer must be string, got integer"),
    ({"answer": "x", "extra": 1}, "unknown argument(s) 'extra'"),
])
def test_bad_arguments_are_an_observation(arguments: dict[str, Any], fragment: str) -> None:
    context = ctx()
    result = run(SubmitAnswerTool().call(arguments, context))
    assert result.error is not None and fragment in result.error
    assert result.final_answer is None and not result.done
    assert result.latency_s >= 0 and "[error]" in result.observation()


def test_schema_checks_types_and_ranges() -> None:
    tool = SearchTool([Document("d1", "t", "x")], max_k=3)
    for bad, fragment in (({"query": "x", "k": 0}, ">= 1"), ({"query": "x", "k": 4}, "<= 3"),
                          ({"query": "x", "k": True}, "must be integer"),
                          ({"query": ""}, "at least 1 characters")):
        result = run(tool.call(bad, ctx()))
        assert result.error is not None and fragment in result.error, (bad, result)


def test_submit_answer_ends_the_episode() -> None:
    result = run(SubmitAnswerTool().call({"answer": "42"}, ctx()))
    assert result.ok and result.final_answer == "42" and result.done


def test_code_tools_refuse_to_run_without_a_sandbox() -> None:
    for tool in (PythonTool(), BashTool(), ReadFileTool()):
        args = {"code": "print(1)"} if tool.name == "python" else (
            {"command": "true"} if tool.name == "bash" else {"path": "x"})
        with pytest.raises(EnvConfigError, match="needs a sandbox"):
            run(tool.call(args, ctx()))


def test_search_tool_is_deterministic_and_ranks_the_matching_document_first() -> None:
    docs = [Document(f"d{i}", f"Doc {i}", f"filler words number {i}") for i in range(20)]
    docs.append(Document("target", "Quillon", "Quillon is a harbour town on the Vess river."))
    tool = SearchTool(docs)
    first = run(tool.call({"query": "Which river flows by Quillon?", "k": 3}, ctx()))
    second = run(tool.call({"query": "Which river flows by Quillon?", "k": 3}, ctx()))
    assert first.ok and first.output == second.output
    assert first.output.startswith("[target] Quillon")
    nothing = run(tool.call({"query": "zzzz qqqq"}, ctx()))
    assert nothing.ok and "no documents match" in nothing.output


# -- tools in a real sandbox --------------------------------------------------------


def in_sandbox(backend: Backend, body: Any, limits: Limits = TEST_LIMITS) -> Any:
    async def go() -> Any:
        async with await backend.backend.start(limits) as sb:
            return await body(ToolContext(task=Task(task_id="t", prompt="p"), sandbox=sb))

    return run(go())


@pytest.mark.integration
def test_python_and_bash_run_in_the_sandbox(sandbox_backend: Backend) -> None:
    async def body(c: ToolContext) -> None:
        py = await PythonTool().call({"code": "import os\nprint(6 * 7, os.getcwd())"}, c)
        assert py.ok and py.output.startswith("42 "), (sandbox_backend.label(), py)
        assert py.latency_s > 0
        sh = await BashTool().call({"command": "echo hi > f.txt && cat f.txt && echo e >&2"}, c)
        assert sh.ok and sh.output == "hi\n[stderr]\ne", (sandbox_backend.label(), sh)
        # files persist between calls, across tools
        read = await ReadFileTool().call({"path": "f.txt"}, c)
        assert read.output == "hi\n", sandbox_backend.label()

    in_sandbox(sandbox_backend, body)


@pytest.mark.integration
def test_exec_failures_are_observations(sandbox_backend: Backend) -> None:
    async def body(c: ToolContext) -> None:
        crash = await PythonTool().call({"code": "print('before')\nraise KeyError('boom')"}, c)
        assert crash.error == "exit status 1", (sandbox_backend.label(), crash)
        assert "before" in crash.output and "KeyError: 'boom'" in crash.output
        slow = await PythonTool(timeout_s=0.5).call({"code": "import time; time.sleep(30)"}, c)
        assert slow.error is not None and "timed out after 0.5 s" in slow.error, slow
        assert slow.latency_s < 30  # killed, not waited for
        missing = await BashTool().call({"command": "no-such-command-xyz"}, c)
        assert missing.error == "exit status 127" and "not found" in missing.output, missing
        noisy = await BashTool(max_output_chars=100).call(
            {"command": "seq 1 5000"}, c)
        assert noisy.ok and "characters omitted" in noisy.output and noisy.output.endswith("5000")

    in_sandbox(sandbox_backend, body)


@pytest.mark.integration
def test_file_tools_errors_are_observations(sandbox_backend: Backend) -> None:
    async def body(c: ToolContext) -> None:
        read = ReadFileTool()
        missing = await read.call({"path": "nope.txt"}, c)
        assert missing.error is not None and "no such file" in missing.error, missing
        escape = await read.call({"path": "../../etc/passwd"}, c)
        assert escape.error is not None and escape.error.startswith("bad path"), escape
        outside = await read.call({"path": "/etc/passwd"}, c)
        assert outside.error is not None and "outside the work dir" in outside.error, outside
        await BashTool().call({"command": "mkdir d && printf 'a\\0b' > bin"}, c)
        directory = await read.call({"path": "d"}, c)
        assert directory.error is not None and "not a regular file" in directory.error
        binary = await read.call({"path": "bin"}, c)
        assert binary.error is not None and "binary" in binary.error
        wrote = await WriteFileTool().call({"path": "pkg/a/b.txt", "content": "1\n2\n3\n"}, c)
        assert wrote.ok and wrote.output == "wrote 6 bytes to pkg/a/b.txt"
        part = await read.call({"path": "pkg/a/b.txt", "start_line": 2, "num_lines": 1}, c)
        assert part.output == "2\n"
        past = await read.call({"path": "pkg/a/b.txt", "start_line": 9}, c)
        assert past.error is not None and "past the end" in past.error
        into_dir = await WriteFileTool().call({"path": "d", "content": "x"}, c)
        assert into_dir.error is not None, into_dir

    in_sandbox(sandbox_backend, body)


@pytest.mark.integration
def test_apply_patch_in_the_sandbox(sandbox_backend: Backend) -> None:
    patch = ("--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n def f():\n-    return 1\n+    return 2\n"
             " \n--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1,2 @@\n+hello\n+world\n"
             "--- a/old.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n")

    async def body(c: ToolContext) -> None:
        sb = c.require_sandbox()
        await sb.put_file("m.py", b"def f():\n    return 1\n\nprint(f())\n")
        await sb.put_file("old.txt", b"bye\n")
        result = await ApplyPatchTool().call({"patch": patch}, c)
        assert result.ok, (sandbox_backend.label(), result)
        assert "modified m.py" in result.output and "created new.txt" in result.output
        assert await sb.get_file("m.py") == b"def f():\n    return 2\n\nprint(f())\n"
        assert await sb.get_file("new.txt") == b"hello\nworld\n"
        gone = await BashTool().call({"command": "test -e old.txt"}, c)
        assert gone.error == "exit status 1"
        # a hunk that does not match changes nothing, not even the files before it
        await sb.put_file("a.txt", b"one\n")
        stale = ("--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-one\n+uno\n"
                 "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n"
                 " def f():\n-    return 1\n+    return 3\n")
        failed = await ApplyPatchTool().call({"patch": stale}, c)
        assert failed.error is not None and "hunk 1 does not apply" in failed.error, failed
        assert "no file changed" in failed.error
        assert await sb.get_file("a.txt") == b"one\n"
        garbage = await ApplyPatchTool().call({"patch": "please fix it"}, c)
        assert garbage.error is not None and "cannot parse the patch" in garbage.error
        absent = await ApplyPatchTool().call(
            {"patch": "--- a/zz.py\n+++ b/zz.py\n@@ -1 +1 @@\n-a\n+b\n"}, c)
        assert absent.error is not None and "no such file" in absent.error

    in_sandbox(sandbox_backend, body)


@pytest.mark.integration
def test_a_closed_sandbox_is_an_infrastructure_error(sandbox_backend: Backend) -> None:
    async def go() -> None:
        sb = await sandbox_backend.backend.start(TEST_LIMITS)
        await sb.close()
        c = ToolContext(task=Task(task_id="t", prompt="p"), sandbox=sb)
        with pytest.raises(SandboxClosed):
            await PythonTool().call({"code": "print(1)"}, c)

    run(go())


@pytest.mark.integration
def test_an_edit_of_the_same_size_is_never_hidden_by_a_stale_pyc(sandbox_backend: Backend) -> None:
    async def body(c: ToolContext) -> None:
        for value in ("1", "2", "3"):  # same size, same second: a cached .pyc would be reused
            await WriteFileTool().call({"path": "m.py", "content": f"X = {value}\n"}, c)
            got = await PythonTool().call({"code": "import m\nprint(m.X)"}, c)
            assert got.output == value, (sandbox_backend.label(), got)
            got = await BashTool().call({"command": "python3 -c 'import m; print(m.X)'"}, c)
            assert got.output == value, (sandbox_backend.label(), got)

    in_sandbox(sandbox_backend, body)

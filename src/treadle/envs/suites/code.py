"""`code`: write a function; hidden unit tests run in the sandbox; reward = fraction passed.

The agent writes ``solution.py`` in the work dir (with `write_file`, `apply_patch`
or `python`), may test it with `python`/`bash`, and ends with `submit_answer`. A
submitted answer (or, without one, a final message) that contains a fenced
```` ```python ```` block is taken as the solution instead of the file.

Grading (in the same sandbox, after the episode): the solution is copied into a
fresh ``.grade-<random>/`` directory next to a harness, which runs under
``python3 -I`` (no work-dir modules on the path, so files the agent planted cannot
shadow the standard library), reads the test *inputs* from stdin, calls the entry
point once per test under a per-test time limit, and prints each return value as
JSON. Expected outputs never enter the sandbox: they are compared on the host
(floats with relative tolerance 1e-6), so printing fake results cannot earn
reward. A solution that crashes on import, hangs or exits early fails the tests it
did not answer; grading as a whole is bounded by the sandbox's wall limit.

Task format::

    {"id": "c1", "problem": "Return the sum of a list of integers.",
     "entry_point": "total", "tests": [{"args": [[1, 2]], "expected": 3}],
     "solution": "def total(xs):\\n    return sum(xs)\\n", "time_limit_s": 2, "examples": 1}

``problem``, ``entry_point`` and ``tests`` (each with ``args``, optional ``kwargs``,
``expected``; JSON values, tuples written as lists) are required. ``solution`` (a
reference, never shown) is optional; ``time_limit_s`` (per test, default 2) and
``examples`` (how many leading tests the prompt shows, default 2) are optional.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping
from typing import Any

from treadle.envs.base import RewardResult, Suite
from treadle.envs.errors import TaskFormatError
from treadle.envs.records import check_keys, opt_float, opt_str, req_list, req_str, rng_for
from treadle.envs.suites._code_bank import PROBLEMS, Problem
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool, ToolContext
from treadle.envs.tools.exec import BashTool, PythonTool
from treadle.envs.tools.files import ReadFileTool, WriteFileTool
from treadle.envs.tools.patch import ApplyPatchTool
from treadle.errors import SandboxFileError, SandboxPathError
from treadle.sandbox.base import Limits
from treadle.types import Task

SOLUTION_FILE = "solution.py"
RANDOM_TESTS = 6  # per bundled problem, on top of the hand-picked ones
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
PROMPT = (
    "Write a Python function `{entry}` in the file `solution.py` in the working directory."
    "\n\n{problem}\n\n{examples}You can create files with `write_file`, run code with "
    "`python` or `bash`, and read files with `read_file`. Hidden tests import `{entry}` from "
    "solution.py and call it with other inputs ({limit:g} s per call). When you are done, "
    "call `submit_answer` with a one-line summary.")
HARNESS = r'''
import json, os, signal, sys

def main():
    spec = json.loads(sys.stdin.read())
    nonce = spec["nonce"]
    out = sys.stdout
    def emit(obj):
        out.write(nonce + json.dumps(obj) + "\n")
        out.flush()
    def on_alarm(signum, frame):
        raise TimeoutError("time limit exceeded")
    signal.signal(signal.SIGALRM, on_alarm)
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    try:
        signal.setitimer(signal.ITIMER_REAL, spec["limit"])
        import solution
        signal.setitimer(signal.ITIMER_REAL, 0)
        fn = getattr(solution, spec["entry"])
    except BaseException as e:
        emit({"load_error": type(e).__name__ + ": " + str(e)[:300]})
        return
    for i, test in enumerate(spec["tests"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, spec["limit"])
            value = fn(*test["args"], **test.get("kwargs", {}))
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"i": i, "value": value})
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            emit({"i": i, "error": type(e).__name__ + ": " + str(e)[:300]})

main()
'''


def values_equal(got: Any, expected: Any) -> bool:
    """JSON values equal; floats within 1e-6 relative; bools are not numbers."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, int | float) and isinstance(got, int | float):
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(
            values_equal(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(
            values_equal(got[k], expected[k]) for k in expected)
    return bool(type(got) is type(expected) and got == expected)


def _roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def bundled_record(problem: Problem) -> dict[str, Any]:
    """The task record of a bundled problem, with expected outputs from its reference."""
    namespace: dict[str, Any] = {}
    exec(problem.solution, namespace)  # our own reference code, on the host
    fn = namespace[problem.entry_point]
    rng = rng_for("code-tests", problem.entry_point)
    arg_lists = list(problem.fixed) + [problem.random_args(rng) for _ in range(RANDOM_TESTS)]
    tests = [{"args": _roundtrip(a), "expected": _roundtrip(fn(*_roundtrip(a)))}
             for a in arg_lists]
    return {"id": f"code-{problem.entry_point}", "problem": problem.statement,
            "entry_point": problem.entry_point, "tests": tests, "solution": problem.solution}


class CodeSuite(Suite):
    """Function-writing problems with hidden tests; see the module docstring."""

    name = "code"
    limits = Limits(cpu_s=10, memory_mb=512, wall_timeout_s=60)

    def __init__(self, *, tool_timeout_s: float = 20.0) -> None:
        self.tool_timeout_s = tool_timeout_s

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` of the 20 bundled problems (None: all) in a seeded order."""
        order = list(PROBLEMS)
        rng_for(self.name, seed).shuffle(order)
        if n is not None and not 0 <= n <= len(order):
            raise ValueError(f"n must be between 0 and {len(order)}, got {n}")
        return [self.task_from_record(bundled_record(p)) for p in order[:n]]

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        check_keys(record, {"problem", "entry_point", "tests", "solution", "time_limit_s",
                            "examples"})
        task_id, problem = req_str(record, "id"), req_str(record, "problem")
        entry = req_str(record, "entry_point")
        if not entry.isidentifier():
            raise TaskFormatError(f"field 'entry_point' must be a Python identifier, "
                                  f"got {entry!r}")
        tests = []
        for k, test in enumerate(req_list(record, "tests")):
            if not isinstance(test, dict) or "expected" not in test or not isinstance(
                    test.get("args", []), list) or not isinstance(test.get("kwargs", {}), dict):
                raise TaskFormatError(f"tests[{k}] must be an object with a list 'args', an "
                                      "optional object 'kwargs' and 'expected'")
            clean = {"args": test.get("args", []), "expected": test["expected"]}
            if test.get("kwargs"):
                clean["kwargs"] = test["kwargs"]
            tests.append(clean)
        limit = opt_float(record, "time_limit_s", 2.0)
        shown = int(opt_float(record, "examples", 2))
        if shown < 0 or limit <= 0:
            raise TaskFormatError("'examples' must be >= 0 and 'time_limit_s' > 0")
        metadata: dict[str, Any] = {"problem": problem, "entry_point": entry, "tests": tests}
        solution = opt_str(record, "solution")
        if solution is not None:
            metadata["solution"] = solution
        if "time_limit_s" in record:
            metadata["time_limit_s"] = limit
        if "examples" in record:
            metadata["examples"] = shown
        examples = "".join(f"    {entry}({', '.join(map(repr, t['args']))}) == "
                           f"{t['expected']!r}\n" for t in tests[:shown] if not t.get("kwargs"))
        prompt = PROMPT.format(entry=entry, problem=problem, limit=limit,
                               examples=f"Examples:\n{examples}\n" if examples else "")
        return self._task(task_id, prompt, metadata)

    def initial_files(self, task: Task) -> Mapping[str, str]:
        """Nothing: the work dir starts empty (the agent writes ``solution.py``; a
        solution given in a fenced block of the answer is the judges' $answer)."""
        return {}

    def tools(self, task: Task) -> list[Tool]:
        return [WriteFileTool(), ReadFileTool(), ApplyPatchTool(),
                PythonTool(timeout_s=self.tool_timeout_s), BashTool(timeout_s=self.tool_timeout_s),
                SubmitAnswerTool("a one-line summary of your solution")]

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        sandbox = ctx.require_sandbox()
        meta = ctx.task.metadata
        tests: list[dict[str, Any]] = meta["tests"]
        source = _fenced(ctx.final_answer if ctx.final_answer is not None else final_message)
        if source is None:
            try:
                source = (await sandbox.get_file(SOLUTION_FILE, max_bytes=1 << 20)).decode(
                    "utf-8", errors="replace")
            except (SandboxFileError, SandboxPathError) as e:  # absent, a link, too big
                return RewardResult(0.0, {"passed": 0.0, "total": float(len(tests))},
                                    f"no usable {SOLUTION_FILE}: {e}")
        grade_dir = f".grade-{secrets.token_hex(6)}"
        await sandbox.put_file(f"{grade_dir}/{SOLUTION_FILE}", source.encode())
        await sandbox.put_file(f"{grade_dir}/_harness.py", HARNESS.encode())
        nonce = f"@@{secrets.token_hex(8)}@@"
        limit = float(meta.get("time_limit_s", 2.0))
        spec = {"nonce": nonce, "entry": meta["entry_point"], "limit": limit,
                "tests": [{"args": t["args"], **({"kwargs": t["kwargs"]} if "kwargs" in t
                                                  else {})} for t in tests]}
        result = await sandbox.exec(["python3", "-I", f"{grade_dir}/_harness.py"],
                                    timeout_s=5 + limit * (len(tests) + 1),
                                    stdin=json.dumps(spec).encode())
        answers: dict[int, Any] = {}
        load_error = None
        for line in result.stdout.splitlines():
            if not line.startswith(nonce):
                continue
            try:
                item = json.loads(line[len(nonce):])
            except json.JSONDecodeError:
                continue
            if "load_error" in item:
                load_error = item["load_error"]
            elif "value" in item and isinstance(item.get("i"), int):
                answers.setdefault(item["i"], item["value"])
        passed = sum(1 for i, t in enumerate(tests)
                     if i in answers and values_equal(answers[i], t["expected"]))
        detail = f"{passed}/{len(tests)} tests passed"
        if load_error:
            detail += f"; solution failed to load: {load_error}"
        elif result.killed:
            detail += f"; grading stopped: {result.killed}"
        return RewardResult(passed / len(tests), {"passed": float(passed),
                                                  "total": float(len(tests))}, detail)


def _fenced(answer: str | None) -> str | None:
    """The last ```python block of a submitted answer, if any."""
    if not answer:
        return None
    blocks = _FENCE.findall(answer)
    return blocks[-1] if blocks else None

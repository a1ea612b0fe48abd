"""The `swe-images` suite: the instance format, pytest's report, grading in a real image.

The grading tests run the built-in instance (six 1.17.0 with its add_metaclass
__qualname__ fix reverted) in its image, built on first use with mmdebstrap and
pip (about 30 s, cached under the image cache's parent afterwards), on real bwrap.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from envs_helpers import run

from treadle.envs import RewardResult, get_suite, open_episode
from treadle.envs.errors import EnvConfigError, TaskFormatError
from treadle.envs.suites._pytest_report import Outcome, outcomes
from treadle.envs.suites.swe_builtin import builtin_specs
from treadle.envs.suites.swe_images import SweImageSuite
from treadle.runtime.suite_pools import SuitePools
from treadle.sandbox import BwrapBackend, LocalBackend
from treadle.sandbox.pool import PoolSettings, SandboxPool
from treadle.sandbox.remote import RemoteBackend
from treadle.types import Task

INSTANCE_ID = "six-add-metaclass-qualname"
F2P = "test_six.py::test_add_metaclass_nested"


def _record(**changes: Any) -> dict[str, Any]:
    record = {**builtin_specs()[INSTANCE_ID]["instance"], "image": "images/six.oci"}
    record.update(changes)
    return {k: v for k, v in record.items() if v is not None}


def _write(path: Path, *records: dict[str, Any] | str) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


# --- the instance format ------------------------------------------------------------

def test_instances_load_from_jsonl_with_relative_images_and_json_string_lists(
        tmp_path: Path) -> None:
    path = _write(tmp_path / "data.jsonl", _record(),
                  _record(instance_id="two", FAIL_TO_PASS=json.dumps([F2P]), test_cmd=None,
                          hints_text="", version="1.17"))
    suite = get_suite("swe-images", instances=str(path))
    tasks = suite.load_tasks(path)
    assert [t.task_id for t in tasks] == [INSTANCE_ID, "two"]
    assert tasks[0].metadata["image"] == str(tmp_path / "images" / "six.oci")
    assert tasks[1].metadata["FAIL_TO_PASS"] == [F2P]
    assert "add_metaclass" in tasks[0].prompt and "orig_vars" not in tasks[0].prompt
    assert suite.task_from_record(suite.task_to_record(tasks[1])) == tasks[1]
    path.unlink()  # read when the suite was made (a service holds the file only then)
    assert {t.task_id for t in suite.tasks(seed=3)} == {INSTANCE_ID, "two"}


@pytest.mark.parametrize(("change", "expected"), [
    ({"FAIL_TO_PASS": None}, ":2: field 'FAIL_TO_PASS': Field required"),
    ({"FAIL_TO_PASS": []}, ":2: field 'FAIL_TO_PASS'"),
    ({"PASS_TO_PASS": "not json"}, ":2: field 'PASS_TO_PASS': Value error, a JSON string"),
    ({"PASS_TO_PASS": [F2P]}, ":2: field 'PASS_TO_PASS': " + repr(F2P)),
    ({"PASS_TO_PASS": ["a.py::t", "a.py::t"]}, "listed twice"),
    ({"FAIL_TO_PASS": [" spaced"]}, "is not a pytest node id"),
    ({"image": ""}, ":2: field 'image'"),
    ({"workdir": "testbed"}, ":2: field 'workdir'"),
    ({"FAIL_TO_PASSS": [F2P]}, ":2: field 'FAIL_TO_PASSS': unknown field"),
    ({"test_patch": "--- a/x\n+++ b/x\nnot a hunk\n"}, ":2: field 'test_patch'"),
    ({"instance_id": INSTANCE_ID}, ":2: duplicate instance_id"),
    ({"FAIL_TO_PASS": ["../up.py::test"]}, "'../up.py' is not a path inside the repository"),
    ({"test_patch": "--- /etc/x\n+++ /etc/x\n@@ -1 +1 @@\n-a\n+b\n"}, "not a path inside"),
])
def test_bad_instances_name_the_line_and_the_field(tmp_path: Path, change: dict[str, Any],
                                                   expected: str) -> None:
    path = _write(tmp_path / "bad.jsonl", _record(), _record(instance_id="other", **change)
                  if "instance_id" not in change else _record(**change))
    with pytest.raises(TaskFormatError) as info:
        SweImageSuite().load_tasks(path)
    assert str(info.value).startswith(f"{path}:") and expected in str(info.value)


def test_a_line_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", _record(), "{nope")
    with pytest.raises(TaskFormatError, match=":2"):
        SweImageSuite().load_tasks(path)


def test_an_image_task_needs_a_backend_that_runs_images(tmp_path: Path) -> None:
    task = SweImageSuite().task_from_record(_record(image="/images/six.oci"))
    with pytest.raises(EnvConfigError, match="the local backend runs no environment images"):
        SweImageSuite().sandbox_backend(task, LocalBackend(work_root=str(tmp_path)))
    # A remote backend asks its servers for the image (they refuse it if they do not
    # serve it: test_sandbox_remote_image.py).
    remote = RemoteBackend(["http://127.0.0.1:1"], "t" * 16)
    assert SweImageSuite().sandbox_backend(task, remote).image == "/images/six.oci"
    host = BwrapBackend(work_root=str(tmp_path))
    suite = SweImageSuite()
    derived = suite.sandbox_backend(task, host)
    assert derived.image == "/images/six.oci" and host.image is None
    assert suite.sandbox_backend(task, host) is derived
    few = SweImageSuite(images_kept=1)
    other = few.task_from_record(_record(image="/images/other.oci"))
    first = few.sandbox_backend(task, host)
    assert few.sandbox_backend(other, host) is not first  # one image kept: the first goes
    assert few.sandbox_backend(task, host) is not first


# --- pytest's report --------------------------------------------------------------------

REPORT = """\
============================= test session starts ==============================
==================================== PASSES ====================================
PASSED t.py::test_fails
=========================== short test summary info ============================
PASSED t.py::test_ok
PASSED t.py::test_param[a - b]
FAILED t.py::test_fails - AssertionError: assert 'B' == 'A.B'
FAILED t.py::test_param[x - y] - assert 1 == 2
ERROR t.py::test_ok - RuntimeError: teardown
XFAIL t.py::test_expected - reason
ERROR t.py - ImportError: no module
========================= 1 failed, 2 passed in 0.10s ==========================
"""


def test_outcomes_are_read_from_the_last_summary_only_by_node_id() -> None:
    found = outcomes(REPORT, ["t.py::test_ok", "t.py::test_fails", "t.py::test_param[a - b]",
                              "t.py::test_param[x - y]", "t.py::test_expected", "t.py::gone"])
    assert found == {"t.py::test_ok": Outcome.ERROR,  # passed, then errored in teardown
                     "t.py::test_fails": Outcome.FAILED,  # the PASSES section is ignored
                     "t.py::test_param[a - b]": Outcome.PASSED,
                     "t.py::test_param[x - y]": Outcome.FAILED,
                     "t.py::test_expected": Outcome.XFAIL,
                     "t.py::gone": Outcome.MISSING}
    assert outcomes("PASSED t.py::test_ok\n", ["t.py::test_ok"]) == {
        "t.py::test_ok": Outcome.MISSING}  # no summary header: nothing is believed


# --- grading in the image ------------------------------------------------------------------

@dataclass
class ScriptedPatchAgent:
    """Test double for a model: applies fixed patches with the suite's own tools, submits."""

    patches: list[str]
    commands: tuple[str, ...] = ()  # bash commands run after the patches

    async def solve(self, suite: SweImageSuite, task: Task,
                    backend: BwrapBackend | SandboxPool) -> tuple[RewardResult, list[str]]:
        async with open_episode(suite, task, backend) as episode:
            errors = []
            for patch in self.patches:
                result = await episode.call("apply_patch", {"patch": patch})
                errors.append(result.error or "")
            for command in self.commands:
                result = await episode.call("bash", {"command": command})
                assert result.error is None, result.error
            await episode.call("submit_answer", {"answer": "done"})
            return await episode.score(), errors


@pytest.fixture(scope="session")
def image_task() -> tuple[SweImageSuite, Task]:
    suite = SweImageSuite(grade_timeout_s=120)
    return suite, suite.tasks(seed=0)[0]


@pytest.fixture(scope="session")
def host_backend() -> Iterator[BwrapBackend]:
    root = tempfile.mkdtemp(prefix="treadle-swe-images-test-", dir="/tmp")
    os.chmod(root, 0o711)
    yield BwrapBackend(work_root=root)
    leaked = sorted(n for n in os.listdir(root) if n.startswith("treadle-sb-"))
    shutil.rmtree(root, ignore_errors=True)
    assert not leaked, f"sandbox work dirs left behind: {leaked}"


def _graded(image_task: tuple[SweImageSuite, Task], backend: BwrapBackend,
            *patches: str, commands: tuple[str, ...] = ()) -> RewardResult:
    suite, task = image_task
    reward, errors = run(ScriptedPatchAgent(list(patches), commands).solve(suite, task, backend),
                         timeout_s=240)
    assert errors == [""] * len(patches)
    return reward


def test_the_unmodified_repository_is_unresolved(image_task: tuple[SweImageSuite, Task],
                                                 host_backend: BwrapBackend) -> None:
    reward = _graded(image_task, host_backend)
    assert reward.reward == 0.0, reward.detail
    assert reward.metrics[f"F2P {F2P}"] == 0.0
    assert reward.metrics["pass_to_pass_passed"] == reward.metrics["pass_to_pass_total"] == 6.0
    assert f"{F2P} failed" in reward.detail


def test_the_gold_patch_resolves_even_when_the_tests_were_tampered_with(
        image_task: tuple[SweImageSuite, Task], host_backend: BwrapBackend) -> None:
    _, task = image_task
    gold = task.metadata["patch"]
    # The agent also edits a PASS_TO_PASS test so that it fails: restored at grading.
    tamper = ("--- a/test_six.py\n+++ b/test_six.py\n@@ -891,1 +891,1 @@\n"
              "-    assert MySlots.__slots__ == [\"a\", \"b\"]\n+    assert False, 'edited'\n")
    reward = _graded(image_task, host_backend, gold, tamper)
    assert reward.reward == 1.0, reward.detail
    assert reward.metrics["resolved"] == 1.0 and reward.metrics[f"F2P {F2P}"] == 1.0
    assert reward.metrics["P2P test_six.py::TestCustomizedMoves::test_moved_attribute"] == 1.0


def test_a_patch_that_breaks_a_pass_to_pass_test_is_unresolved(
        image_task: tuple[SweImageSuite, Task], host_backend: BwrapBackend) -> None:
    _, task = image_task
    breaking = ("--- a/six.py\n+++ b/six.py\n@@ -891,4 +891,4 @@\n"
                "             if isinstance(slots, str):\n"
                "                 slots = [slots]\n"
                "             for slots_var in slots:\n"
                "-                orig_vars.pop(slots_var)\n"
                "+                pass\n")
    reward = _graded(image_task, host_backend, task.metadata["patch"], breaking)
    assert reward.reward == 0.0, reward.detail
    assert reward.metrics[f"F2P {F2P}"] == 1.0
    assert reward.metrics["P2P test_six.py::test_add_metaclass"] == 0.0
    assert "test_six.py::test_add_metaclass failed" in reward.detail


def test_the_service_pools_run_each_task_on_its_image(
        image_task: tuple[SweImageSuite, Task], host_backend: BwrapBackend) -> None:
    suite, task = image_task
    pools = SuitePools(host_backend, PoolSettings(warm=1))
    plain, on_image = pools.pool(suite), pools.pool(suite, task)
    assert plain is not None and on_image is not None
    assert plain.backend is host_backend and on_image is pools.pool(suite, task)
    assert on_image.backend.image == task.metadata["image"]  # type: ignore[attr-defined]
    assert plain.warm == 1 and on_image.warm == 0  # no idle spares piling up per image

    async def body() -> tuple[RewardResult, list[str]]:
        try:
            with pytest.raises(EnvConfigError, match="runs on a backend of its own"):
                async with open_episode(suite, task, plain):
                    pass
            return await ScriptedPatchAgent([task.metadata["patch"]]).solve(
                suite, task, on_image)
        finally:
            await pools.close()

    reward, errors = run(body(), timeout_s=240)
    assert errors == [""] and reward.reward == 1.0, reward.detail


def test_a_test_file_replaced_by_a_directory_or_a_link_is_restored(
        image_task: tuple[SweImageSuite, Task], host_backend: BwrapBackend) -> None:
    _, task = image_task
    reward = _graded(image_task, host_backend, task.metadata["patch"], commands=(
        "rm test_six.py && mkdir test_six.py && touch test_six.py/x",))
    assert reward.reward == 1.0, reward.detail
    reward = _graded(image_task, host_backend, task.metadata["patch"], commands=(
        "printf 'def test_add_metaclass_nested(): pass\\n' > /tmp/t.py && rm test_six.py "
        "&& ln -s /tmp/t.py test_six.py",))
    assert reward.reward == 1.0, reward.detail
    assert reward.metrics["pass_to_pass_passed"] == 6.0

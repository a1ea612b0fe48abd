"""A harness job on an image task: the task's episode is opened in its image when the
session starts and its tools are served to the harness (`TREADLE_TOOLS_URL`), on
real bwrap, the built-in `swe-images` instance (six, its Debian image built once and
cached), a scripted engine (`FakeVLLMServer`) and a scripted harness
(`scripted_tools_harness.py`). The verifier scores the served episode: the gold
patch applied through the tools resolves the instance, nothing applied does not;
every sandbox is released however the run ended."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from service_helpers import running

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.agent.chat import Call, HermesFormat
from treadle.cli import main
from treadle.client import RolloutClient
from treadle.envs.suites.swe_images import SweImageSuite
from treadle.gateway.harness import Harness
from treadle.sandbox import BwrapBackend, LocalBackend
from treadle.service.schemas import EngineRequest
from treadle.service.state import Service, ServiceConfig
from treadle.store.export import read_parquet
from treadle.types import FailureStage, RewardSource, Trajectory, TrajectoryStatus

pytestmark = [pytest.mark.integration]
HARNESS = str(Path(__file__).with_name("scripted_tools_harness.py"))
F2P = "test_six.py::test_add_metaclass_nested"
JOB = {"tasks": {"suite": "swe-images", "count": 1}, "samples_per_task": 1}


@pytest.fixture(scope="module")
def sandbox_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="treadle-harness-tools-", dir="/tmp"))
    os.chmod(root, 0o711)  # the sandbox uid must be able to traverse it
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _left(root: Path) -> list[str]:
    """Sandbox work dirs still there (a sandbox not released)."""
    return sorted(n for n in os.listdir(root) if n.startswith("treadle-sb-"))


def _harness(name: str, report: Path, **env: str) -> Harness:
    report.mkdir()
    return Harness(name, (sys.executable, HARNESS), timeout_s=300,
                   env={"SCRIPT_REPORT": str(report), **env})


def _free(service: Service) -> bool:
    """No sandbox of the service's pools is live (in use, warm or starting)."""
    return all(stats.live == 0 for _, stats in service.sandboxes.stats())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, sandbox_root: Path
         ) -> dict[str, tuple[Trajectory, dict[str, Any]]]:
    """Each scripted harness's job, run once on one service: its trajectory and what
    the harness saw."""
    tmp = tmp_path_factory.mktemp("harness-tools")
    tok = build_tokenizer(tmp / "tok")
    task = SweImageSuite().tasks()[0]
    (tmp / "gold.patch").write_text(task.metadata["patch"])
    harnesses = {
        "gold": _harness("gold", tmp / "gold", SCRIPT_PATCH=str(tmp / "gold.patch")),
        "idle": _harness("idle", tmp / "idle"),
        "crash": _harness("crash", tmp / "crash", SCRIPT_PATCH=str(tmp / "gold.patch"),
                          SCRIPT_THEN="crash")}
    fake = FakeVLLMServer(reply_ids=[*tok.encode("I will fix it."), tok.token_id("<|im_end|>")])
    out: dict[str, tuple[Trajectory, dict[str, Any]]] = {}
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp / "tok"), harnesses=harnesses,
                               sandbox=BwrapBackend(work_root=str(sandbox_root)))
        with running(config) as (url, service), RolloutClient(url) as client:
            for name in harnesses:
                job = client.submit({**JOB, "harness": {"name": name}, "job_id": name})
                (delivered,) = client.trajectories(job.job_id, follow=True)
                report = json.loads((tmp / name / "report.json").read_text())
                out[name] = (delivered.trajectory, report)
                # Delivered after its run ended: the run's sandbox is released by then.
                assert _free(service), service.sandboxes.stats()
                assert _left(sandbox_root) == [], name
    return out


def test_the_gold_patch_applied_through_the_tools_resolves_the_instance(
        runs: dict[str, tuple[Trajectory, dict[str, Any]]]) -> None:
    traj, report = runs["gold"]
    assert report["applied"]["ok"] and report["applied"]["error"] is None, report["applied"]
    assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
    assert traj.reward == 1.0 and traj.reward_source is RewardSource.VERIFIER
    assert traj.metrics["resolved"] == 1.0 and traj.metrics[f"F2P {F2P}"] == 1.0
    # The calls are in the record as the agent loop keeps them: the reply's turn holds
    # the first call that ran after it, the later ones' seconds added to it.
    (turn,) = traj.turns
    assert turn.tool_call is not None and turn.tool_call.name == "apply_patch"
    assert turn.tool_call.error is None and turn.tool_call.latency_s > 0
    assert "patch" in turn.tool_call.arguments


def test_the_same_harness_applying_nothing_is_unresolved(
        runs: dict[str, tuple[Trajectory, dict[str, Any]]]) -> None:
    traj, report = runs["idle"]
    assert "applied" not in report
    assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
    assert traj.reward == 0.0 and traj.metrics[f"F2P {F2P}"] == 0.0
    assert traj.metrics["pass_to_pass_passed"] == traj.metrics["pass_to_pass_total"]
    (turn,) = traj.turns
    assert turn.tool_call is not None and turn.tool_call.name == "bash"


def test_the_harness_commands_run_in_the_tasks_image_and_bad_calls_are_data(
        runs: dict[str, tuple[Trajectory, dict[str, Any]]]) -> None:
    _, report = runs["idle"]
    assert report["tools_url"].endswith("/tools")
    assert report["tools"] == [t.name for t in SweImageSuite().tools(
        SweImageSuite().tasks()[0])]
    ran = report["ran"]
    assert ran["ok"], ran
    # The image's Debian, not the host's, and the image's working dir.
    assert "VERSION_CODENAME=trixie" in ran["output"]
    assert ran["output"] != Path("/etc/os-release").read_text()
    assert ran["output"].rstrip().endswith("/testbed")
    # A call before the first reply is refused; bad arguments are the tool's error
    # result; an unknown tool a 404 in the service's error shape.
    assert report["before_reply"] == 409
    assert not report["bad_arguments"]["ok"] and "command" in report["bad_arguments"]["error"]
    assert "not valid JSON" in report["not_json"]["error"]
    assert report["unknown"][0] == 404 and "no tool 'no_such_tool'" in \
        report["unknown"][1]["detail"]


def test_a_crashing_harness_is_an_infrastructure_failure_and_frees_its_sandbox(
        runs: dict[str, tuple[Trajectory, dict[str, Any]]]) -> None:
    traj, report = runs["crash"]
    assert report["applied"]["ok"]  # it worked in the sandbox, then crashed
    assert traj.status is TrajectoryStatus.ERROR
    assert traj.failure_stage is FailureStage.HARNESS and traj.reward is None
    assert traj.reason is not None and "scripted crash" in traj.reason


def test_a_service_shutdown_mid_run_releases_the_sandbox_and_a_restart_starts_over(
        tmp_path: Path, sandbox_root: Path) -> None:
    """A run the service's shutdown interrupts releases its sandbox; the restarted
    service runs it again as a new attempt, harness and sandbox both fresh: nothing
    of the first attempt's work is there, nor in the record."""
    tok = build_tokenizer(tmp_path / "tok")
    hang = _harness("run", tmp_path / "first", SCRIPT_THEN="hang")
    os.mkfifo(tmp_path / "first" / "ready")
    fake = FakeVLLMServer(reply_ids=[*tok.encode("I will fix it."), tok.token_id("<|im_end|>")])
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"), harnesses={"run": hang},
                               sandbox=BwrapBackend(work_root=str(sandbox_root)))
        with running(config) as (url, service), RolloutClient(url) as client:
            client.submit({**JOB, "harness": {"name": "run"}, "job_id": "restarted"})
            # The harness has made its calls in the sandbox and now waits to be killed.
            assert (tmp_path / "first" / "ready").read_text() == "ready"
            assert _left(sandbox_root) != []
        assert _free(service), service.sandboxes.stats()
        assert _left(sandbox_root) == []
        first = json.loads((tmp_path / "first" / "report.json").read_text())
        again = {"run": _harness("run", tmp_path / "again")}  # this one exits
        with running(dataclasses.replace(config, harnesses=again)) as (url, service), \
                RolloutClient(url) as client:
            (delivered,) = client.trajectories("restarted", follow=True)
    second = json.loads((tmp_path / "again" / "report.json").read_text())
    assert first["mark"] == second["mark"] == "fresh"
    traj = delivered.trajectory
    assert traj.attempt == 1 and traj.status is TrajectoryStatus.COMPLETED, traj.reason
    assert len(traj.turns) == 1 and traj.reward == 0.0  # the second attempt's own
    assert _left(sandbox_root) == []


def test_the_example_harness_fixes_the_instance_with_the_models_tool_calls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/gateway.md's `treadle run` of `treadle.examples.tools_harness`, which offers
    the served tools to the model and runs its calls there: a scripted model that reads
    the OS, applies the gold patch and submits resolves the instance."""
    tok = build_tokenizer(tmp_path / "tok")
    task = SweImageSuite().tasks()[0]
    calls = [("bash", {"command": "cat /etc/os-release"}),
             ("apply_patch", {"patch": task.metadata["patch"]}),
             ("submit_answer", {"answer": "add_metaclass keeps __qualname__"})]
    script = [[*tok.encode(HermesFormat().reply_text("", [Call.of(name, arguments)])),
               tok.token_id("<|im_end|>")] for name, arguments in calls]
    fake = FakeVLLMServer(script=script)
    with fake.serve() as engine:
        # The test tokenizer is trained on a tiny corpus: a patch takes many tokens.
        code = main(["run", "--suite", "swe-images", "--n", "1", "--engine", engine,
                     "--served-model", "m", "--tokenizer", str(tmp_path / "tok"),
                     "--sandbox", "bwrap", "--harness",
                     f"{sys.executable} -m treadle.examples.tools_harness",
                     "--max-total-tokens", "32768", "--max-tokens-per-turn", "8192",
                     "--job-id", "example", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    (traj,) = [t for _, t in read_parquet(tmp_path / "example.parquet")]
    assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
    assert traj.reward == 1.0 and traj.metrics[f"F2P {F2P}"] == 1.0, traj.metrics
    ran = [t.tool_call for t in traj.turns]
    assert [(c.name, c.error) for c in ran if c is not None] == [
        (name, None) for name, _ in calls]
    # The model saw the image's Debian: the first tool result is in its next prompt.
    assert "VERSION_CODENAME=trixie" in tok.decode(fake.requests[1]["prompt"])


def test_an_episode_that_cannot_be_opened_fails_the_run_before_its_harness_starts(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    idle = _harness("idle", tmp_path / "idle")
    fake = FakeVLLMServer(reply_ids=[*tok.encode("I will fix it."), tok.token_id("<|im_end|>")])
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"), harnesses={"idle": idle},
                               sandbox=LocalBackend(work_root=str(tmp_path / "sb")))
        with running(config) as (url, _), RolloutClient(url) as client:
            job = client.submit({**JOB, "harness": {"name": "idle"}})
            (delivered,) = client.trajectories(job.job_id, follow=True)
    traj = delivered.trajectory
    assert traj.status is TrajectoryStatus.ERROR and traj.failure_stage is FailureStage.INIT
    assert traj.reason is not None and "runs no environment images" in traj.reason
    assert not (tmp_path / "idle" / "report.json").exists()  # the harness never ran
    assert fake.requests == []

"""Running a harness command and judging its run: a crash is an infrastructure
failure, a bad finish is data; limits, the reward file and the answer file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import select
import sys
from pathlib import Path

import pytest

from treadle.gateway.harness import (
    Harness,
    HarnessEnv,
    HarnessRun,
    judge,
    parse_command,
    parse_reward,
    run_harness,
)
from treadle.types import FailureStage, RewardSource, TrajectoryStatus

ENV = HarnessEnv("http://127.0.0.1:9/v1/sessions/s/openai/v1", "tok", "s",
                 {"task_id": "t", "prompt": "2 + 2?", "tools": []})
TRUSTING = dataclasses.replace(ENV, reads_reward=True)  # a job scored by the reward file


def _run(code: str, env: HarnessEnv = ENV, **limits: float) -> HarnessRun:
    harness = Harness("h", (sys.executable, "-c", code), **limits)  # type: ignore[arg-type]
    return asyncio.run(run_harness(harness, env))


ANSWERS = ("import json, os, sys\n"
           "task = json.loads(sys.stdin.read())\n"
           "assert json.loads(os.environ['TREADLE_TASK']) == task\n"
           "assert os.environ['OPENAI_BASE_URL'].endswith('/openai/v1')\n"
           "assert os.environ['OPENAI_API_KEY'] == 'tok'\n"
           "assert 'TREADLE_TOOLS_URL' not in os.environ\n"  # no tools served
           "open(os.environ['TREADLE_ANSWER_FILE'], 'w').write(task['prompt'][:5])\n"
           "open(os.environ['TREADLE_REWARD_FILE'], 'w').write('{\"reward\": 0.5, "
           "\"rewards\": {\"style\": 1}}')\n")


def test_the_harness_gets_its_session_and_task_and_can_answer() -> None:
    run = _run(ANSWERS, TRUSTING)
    assert run.exit_code == 0, run.stderr_tail
    assert run.answer == "2 + 2" and run.reward_file is not None
    verdict = judge(run, "reward_file")
    assert (verdict.status, verdict.reward, verdict.rewards, verdict.source) == (
        TrajectoryStatus.COMPLETED, 0.5, {"style": 1.0}, RewardSource.REWARD_FILE)


def test_the_harness_is_told_where_its_served_tools_are() -> None:
    served = dataclasses.replace(ENV, tools_url="http://127.0.0.1:9/v1/sessions/s/tools")
    run = _run("import os, sys; sys.exit(os.environ['TREADLE_TOOLS_URL'] != "
               "'http://127.0.0.1:9/v1/sessions/s/tools')", served)
    assert run.exit_code == 0, run.stderr_tail


@pytest.mark.parametrize("score", ["verifier", "auto", "exit_code"])
def test_a_reward_file_counts_only_where_the_job_chose_it(score: str) -> None:
    run = _run(ANSWERS)  # written, but the job did not choose it: not even read
    assert run.exit_code == 0 and run.reward_file is None
    verdict = judge(run, score)  # type: ignore[arg-type]
    assert verdict.rewards == {}
    assert (verdict.reward, verdict.verify, verdict.source) == (
        (1.0, False, RewardSource.EXIT_CODE) if score == "exit_code" else (None, True, None))


@pytest.mark.parametrize(("code", "score", "status", "reward", "verify"), [
    ("pass", "auto", TrajectoryStatus.COMPLETED, None, True),
    ("raise SystemExit(1)", "exit_code", TrajectoryStatus.COMPLETED, 0.0, False),
    ("pass", "exit_code", TrajectoryStatus.COMPLETED, 1.0, False),
])
def test_a_finished_run_is_data(code: str, score: str, status: TrajectoryStatus,
                                reward: float | None, verify: bool) -> None:
    verdict = judge(_run(code), score)  # type: ignore[arg-type]
    assert (verdict.status, verdict.reward, verdict.verify, verdict.stage) == (
        status, reward, verify, None)


@pytest.mark.parametrize("code", ["import sys; sys.stderr.write('boom'); sys.exit(3)",
                                  "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
                                  "raise ValueError('bad')"])
@pytest.mark.parametrize("score", ["auto", "verifier", "reward_file"])
def test_a_crashed_harness_is_an_infrastructure_failure(code: str, score: str) -> None:
    verdict = judge(_run(code), score)  # type: ignore[arg-type]
    assert verdict.status is TrajectoryStatus.ERROR and verdict.stage is FailureStage.HARNESS
    assert verdict.reward is None and verdict.reason is not None
    assert "crashed" in verdict.reason


# A harness that starts a child, says the child's pid through the FIFO named by its
# argument, and then hangs (both wait for a signal: neither ever exits by itself).
SPAWNS = ("import signal, subprocess, sys\n"
          "p = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
          "with open(sys.argv[1], 'w') as f:\n"
          "    f.write(str(p.pid))\n"
          "signal.pause()\n")


def _fifo(path: Path) -> int:
    """A FIFO at `path`, opened for reading (before the harness writes to it)."""
    os.mkfifo(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def _pid_from(fd: int, wait_s: float | None) -> int | None:
    """The pid written to the FIFO: waited for up to `wait_s` (a bound for a hang),
    or None when nothing was written."""
    if wait_s is not None:
        select.select([fd], [], [], wait_s)
    try:
        data = os.read(fd, 64)
    except BlockingIOError:
        return None
    return int(data) if data else None


def _dies(pid: int) -> bool:
    """Whether `pid` exits within a minute (a bound for a hang): waits on a pidfd,
    which becomes readable when the process exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], 60.0)[0])
    finally:
        os.close(fd)


def test_a_run_past_its_time_is_a_timeout_and_leaves_nothing_running(tmp_path: Path) -> None:
    # The check of the child must run: a machine too slow to start it before the
    # time is up gets a longer time (four tries, up to 128 s: a bound for a hang).
    child = None
    for attempt, timeout_s in enumerate((2.0, 8.0, 32.0, 128.0)):
        fifo = _fifo(tmp_path / f"child-{attempt}.pid")
        harness = Harness("h", (sys.executable, "-c", SPAWNS,
                                str(tmp_path / f"child-{attempt}.pid")), timeout_s=timeout_s)
        run = asyncio.run(run_harness(harness, ENV))
        assert run.timed_out and run.exit_code is None
        assert judge(run, "auto").status is TrajectoryStatus.TIMEOUT
        child = _pid_from(fifo, None)
        os.close(fifo)
        if child is not None:
            break
    assert child is not None, "the harness never started its child, even in 128 s"
    assert _dies(child), "the harness's child survived"


def test_a_cancelled_run_kills_the_harness_and_what_it_started(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "child.pid")
    harness = Harness("h", (sys.executable, "-c", SPAWNS, str(tmp_path / "child.pid")),
                      timeout_s=600.0)

    async def main() -> int | None:
        task = asyncio.ensure_future(run_harness(harness, ENV))
        child = await asyncio.to_thread(_pid_from, fifo, 60.0)  # its child is running
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return child

    child = asyncio.run(main())
    assert child is not None, "the harness never started its child"
    assert _dies(child), "the harness's child survived"


def test_a_bad_reward_file_or_a_missing_one_is_the_harness_failing() -> None:
    run = _run("import os; open(os.environ['TREADLE_REWARD_FILE'], 'w').write('NaN')",
               TRUSTING)
    assert judge(run, "reward_file").stage is FailureStage.HARNESS
    assert judge(_run("pass", TRUSTING), "reward_file").stage is FailureStage.HARNESS
    assert parse_reward("1") == (1.0, {})
    for bad in ["true", '{"reward": "1"}', '{"reward": 1, "rewards": {"a": "x"}}', "1e400"]:
        with pytest.raises(ValueError):
            parse_reward(bad)


def test_what_the_harness_leaves_is_read_safely(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host file")
    run = _run(f"import os; os.symlink({str(secret)!r}, os.environ['TREADLE_ANSWER_FILE']);"
               "os.mkfifo(os.environ['TREADLE_REWARD_FILE'])", TRUSTING)
    assert run.answer is None and run.reward_file is None  # no host file, no blocking


def test_a_command_that_does_not_exist_raises_and_commands_are_split() -> None:
    with pytest.raises(OSError):
        asyncio.run(run_harness(Harness("h", ("/nonexistent/harness",)), ENV))
    assert parse_command("python -m x --flag 'a b'") == ("python", "-m", "x", "--flag", "a b")
    with pytest.raises(ValueError):
        parse_command("  ")
    assert json.loads(json.dumps(ENV.task)) == dict(ENV.task)

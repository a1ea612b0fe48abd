"""Running an agent harness for one session, and what its run says about the episode.

    harness = Harness("mini", ("python", "my_agent.py"), timeout_s=600)
    run = await run_harness(harness, HarnessEnv(base_url, session_key, session_id, task))
    verdict = judge(run, score="verifier")

`run_harness` starts the command as a subprocess of its own (a new session and
process group, killed with treadle if treadle dies) in a fresh private work
directory, with the service's PATH, HOME, locale, VIRTUAL_ENV, PYTHONPATH and CA
settings (`PASSED_ENV`: no other variable of the service's), `Harness.env`, and
these — an unmodified OpenAI-based harness needs only the first two:

=====================  =========================================================
OPENAI_BASE_URL        the session's gateway URL (also OPENAI_API_BASE, which
                       litellm and older SDKs read)
OPENAI_API_KEY         the session's own key: it opens this session's OpenAI
                       routes and nothing else, and dies with the session (never
                       the service's token)
TREADLE_SESSION_ID     the session
TREADLE_TASK           the task as JSON: ``{"task_id", "prompt", "tools"}`` (the
                       suite's tool specs); never its hidden data (answers, tests)
TREADLE_TASK_FILE      the same JSON in a file (also written to the harness's stdin)
TREADLE_ANSWER_FILE    where the harness may write its final answer (a suite's
                       verifier scores it; else the session's last reply)
TREADLE_REWARD_FILE    where the harness may write its own reward: a number, or
                       ``{"reward": x, "rewards": {name: value}}``; read only
                       when the job's score is ``reward_file``
TREADLE_TOOLS_URL      only when the task's tools are served (below): the
                       session's tools, ``GET`` it for their specs, ``POST
                       <url>/<name>`` with the arguments as JSON to call one
                       (the session's key as bearer)
=====================  =========================================================

Served tools: a task whose suite needs a sandbox (`Suite.needs_sandbox`, e.g. a
``swe-images`` instance on its image) has its episode opened when the session
starts, in the service's sandbox pool for it (the one treadle's own agent loop
uses), and its tools served to the harness at ``TREADLE_TOOLS_URL``
(``/v1/sessions/{id}/tools``, `gateway.tools`): the harness's commands run in the
task's sandbox, not on the host, and each call is recorded in the session's
trajectory as the agent loop records its tool calls. The episode is closed and its
sandbox released when the session ends, however it ends (the harness's exit or
crash, its timeout, the job's cancel, the service's shutdown). Without a sandbox
backend, or for a suite that needs none, nothing is served (as before).

A restart of the service ends the harness with it; the run starts over as a new
attempt (a new session, a fresh episode and sandbox, the harness started again):
a sandbox cannot be brought back, so nothing of the first attempt's work is served
as if it were there, and its record is the new attempt's alone.

Limits: the whole run must end within `timeout_s` (then the process group is
killed), address space `max_memory_mb` and CPU time `max_cpu_s` per process
(rlimits). A harness is not sandboxed by treadle: it must reach the gateway over
the network, and it runs its own tools unless they are served (a harness that can,
like mini-swe-agent with bubblewrap, sandboxes its commands itself). Treat harness commands as
trusted code configured by the operator; a job only names one. What the model
makes the harness run is not trusted: docs/security.md.

`judge` turns the run into the episode's outcome. The rule that keeps training
data honest: a harness that *crashes* is an infrastructure failure (status error,
stage harness: excluded, never reward 0), one that *finishes badly* is data.

=====================  =========================================================
exit 0                 finished: scored (`score` below)
exit 1, under          finished, failed: reward 0 (a command whose exit status is
``exit_code``          its verdict, like a test runner: pytest exits 1 when tests
                       fail, 2 and up when it could not run them)
any other exit, or a   crashed: status error, stage harness, its stderr's tail
signal                 in the reason (Python exits 1 on an uncaught exception,
                       so exit 1 is a crash under every other score)
timeout                status timeout, scored like a finished run
=====================  =========================================================

Scores, and what each trusts (`Verdict.source` names it, and the record keeps it):

- ``verifier`` (the default): the suite's verifier on the final answer, with the
  task's hidden data. With tools served, it scores the served episode, after the
  harness has ended and its last tool call has stopped: the sandbox's state is the
  policy's work, as the answer is, and the suite restores what it must not trust
  (``swe-images`` puts the graded test files back from the instance before it runs
  them). Without, it scores a fresh episode. It trusts nothing the run writes but
  the answer and what it did through the served tools, both the policy's to give.
  ``auto`` is read as ``verifier`` (it once preferred the reward file: jobs stored
  with it run the same way).
- ``exit_code``: exit 0 is 1.0, exit 1 is 0.0. It trusts the harness command's
  exit status: the operator's command (a test runner judging the work), which a
  model-written command can sway only by what it changes in what that command
  checks.
- ``reward_file``: the harness's own word, ``TREADLE_REWARD_FILE`` (it must be
  there and valid, else a harness failure). It trusts the harness *and everything
  it runs*: a command the harness runs in its own environment (same user, same
  files) can write that file as well as the harness can, so take it only from a
  harness that runs its model's commands in a sandbox that cannot reach the file
  (the example harness's bubblewrap does not mount the work directory). treadle
  cannot check that it does: choosing this score is the job's statement that it
  trusts the harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

from treadle.runtime.launcher import die_with_parent
from treadle.types import FailureStage, RewardSource, TrajectoryStatus

Score = Literal["verifier", "exit_code", "reward_file", "auto"]
STDERR_TAIL = 2000  # characters of a crashed harness's stderr kept in the reason
# The service's environment variables a harness inherits (`Harness.env` adds more).
PASSED_ENV = frozenset({"PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
                        "VIRTUAL_ENV", "PYTHONPATH", "SSL_CERT_FILE", "SSL_CERT_DIR"})


@dataclass(frozen=True, slots=True)
class Harness:
    """A harness command the operator configured (a job names it)."""

    name: str  # what a job's `harness.name` says
    command: tuple[str, ...]  # argv; run in a fresh work directory
    timeout_s: float = 900.0  # the whole run, real seconds
    max_memory_mb: int | None = 8192  # RLIMIT_AS of each of its processes
    max_cpu_s: int | None = None  # RLIMIT_CPU of each of its processes
    env: Mapping[str, str] = field(default_factory=dict)  # more environment variables


@dataclass(frozen=True, slots=True)
class HarnessEnv:
    """What one run is told."""

    base_url: str  # the session's OpenAI base URL
    api_key: str  # the session's key (never the service's token)
    session_id: str
    task: Mapping[str, Any]  # {"task_id", "prompt", "tools"}: nothing hidden
    reads_reward: bool = False  # the job scores by the reward file: read it after the run
    tools_url: str | None = None  # the session's served tools (None: none are served)


@dataclass(frozen=True, slots=True)
class HarnessRun:
    """How one run went."""

    exit_code: int | None  # None when killed at the timeout or by a signal
    signal: int | None  # the signal that ended it, if one did (not our timeout kill)
    timed_out: bool
    seconds: float  # wall time
    stderr_tail: str  # the last STDERR_TAIL characters of its stderr
    answer: str | None  # what it wrote to TREADLE_ANSWER_FILE
    # What it wrote to TREADLE_REWARD_FILE (unparsed); None when not read (the job's
    # score is not reward_file) or not written.
    reward_file: str | None


@dataclass(frozen=True, slots=True)
class Verdict:
    """The episode's outcome from a run: a status, and a reward or the need to verify."""

    status: TrajectoryStatus
    reason: str | None = None
    stage: FailureStage | None = None  # set for a harness failure
    reward: float | None = None  # set when the run says it
    rewards: dict[str, float] = field(default_factory=dict)
    verify: bool = False  # the suite's verifier must score the final answer
    source: RewardSource | None = None  # what scored it (the verifier once it has)


async def run_harness(harness: Harness, env: HarnessEnv) -> HarnessRun:
    """Run `harness` once (module docstring); never raises for what the harness does
    (OSError if it cannot be started at all: no such program)."""
    work = Path(tempfile.mkdtemp(prefix=f"treadle-harness-{harness.name}-"))
    try:
        task_json = json.dumps(dict(env.task), ensure_ascii=False)
        (work / "task.json").write_text(task_json, encoding="utf-8")
        # Only what a program needs to run: the service's own secrets (cloud tokens,
        # the store's paths) are not the harness's, nor the model-written commands'.
        variables = {
            **{k: v for k, v in os.environ.items() if k in PASSED_ENV}, **harness.env,
            "OPENAI_BASE_URL": env.base_url, "OPENAI_API_BASE": env.base_url,
            "OPENAI_API_KEY": env.api_key, "TREADLE_SESSION_ID": env.session_id,
            "TREADLE_TASK": task_json, "TREADLE_TASK_FILE": str(work / "task.json"),
            "TREADLE_ANSWER_FILE": str(work / "answer.txt"),
            "TREADLE_REWARD_FILE": str(work / "reward.json")}
        if env.tools_url is not None:
            variables["TREADLE_TOOLS_URL"] = env.tools_url
        started = time.monotonic()
        # An unlinked file: nothing the harness does to its work dir reaches it.
        with tempfile.TemporaryFile() as stderr:
            proc = await asyncio.create_subprocess_exec(
                *harness.command, cwd=work, env=variables, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                preexec_fn=_limits(harness))
            timed_out = False
            try:
                async with asyncio.timeout(harness.timeout_s):
                    assert proc.stdin is not None
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        proc.stdin.write(task_json.encode())
                        await proc.stdin.drain()
                        proc.stdin.close()
                    await proc.wait()
            except TimeoutError:
                timed_out = True
            finally:
                _kill_group(proc.pid)  # what it left running dies with it
                await proc.wait()
            tail = _tail(stderr)
        code = proc.returncode
        return HarnessRun(
            exit_code=None if timed_out or code is None or code < 0 else code,
            signal=-code if code is not None and code < 0 and not timed_out else None,
            timed_out=timed_out, seconds=time.monotonic() - started,
            stderr_tail=tail, answer=_read(work / "answer.txt"),
            reward_file=_read(work / "reward.json") if env.reads_reward else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def judge(run: HarnessRun, score: Score) -> Verdict:
    """The episode's outcome (module docstring's table)."""
    if run.timed_out:
        finished = Verdict(TrajectoryStatus.TIMEOUT, "harness timeout")
    elif run.exit_code == 0 or (run.exit_code == 1 and score == "exit_code"):
        finished = Verdict(TrajectoryStatus.COMPLETED)
    else:
        how = f"signal {run.signal}" if run.signal else f"exit code {run.exit_code}"
        tail = run.stderr_tail.strip()
        return Verdict(TrajectoryStatus.ERROR, f"harness: crashed ({how})"
                       + (f": {tail}" if tail else ""), FailureStage.HARNESS)
    if score == "exit_code":  # (timed out: no exit code, so 0)
        return Verdict(finished.status, finished.reason,
                       reward=float(run.exit_code == 0 and not run.timed_out),
                       source=RewardSource.EXIT_CODE)
    if score == "reward_file":
        if run.reward_file is None:
            return Verdict(TrajectoryStatus.ERROR, "harness: it wrote no reward file",
                           FailureStage.HARNESS)
        try:
            reward, rewards = parse_reward(run.reward_file)
        except ValueError as e:
            return Verdict(TrajectoryStatus.ERROR, f"harness: {e}", FailureStage.HARNESS)
        return Verdict(finished.status, finished.reason, reward=reward, rewards=rewards,
                       source=RewardSource.REWARD_FILE)
    # verifier (and auto, its old name's): nothing the run wrote but its answer counts.
    return Verdict(finished.status, finished.reason, verify=True)


def parse_reward(text: str) -> tuple[float, dict[str, float]]:
    """A reward file: a number, or {"reward": x, "rewards": {...}}; ValueError saying
    what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"its reward file is not JSON: {text[:80]!r}") from None
    rewards: Any = {}
    if isinstance(value, dict):
        rewards = value.get("rewards", {})
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"its reward file holds no finite reward: {text[:80]!r}")
    if not isinstance(rewards, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in rewards.values()):
        raise ValueError("its reward file's rewards must map names to finite numbers")
    return float(value), {str(k): float(v) for k, v in rewards.items()}


def parse_command(text: str | Sequence[str]) -> tuple[str, ...]:
    """A harness command line (a shell-like string, split without a shell)."""
    import shlex

    argv = tuple(shlex.split(text)) if isinstance(text, str) else tuple(text)
    if not argv:
        raise ValueError("the harness command is empty")
    return argv


def _limits(harness: Harness) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec
        die_with_parent()
        if harness.max_memory_mb is not None:
            size = harness.max_memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (size, size))
        if harness.max_cpu_s is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (harness.max_cpu_s, harness.max_cpu_s))
    return apply


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _tail(file: BinaryIO) -> str:
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - STDERR_TAIL))
    return file.read().decode("utf-8", "replace")


def _read(path: Path, limit: int = 1 << 20) -> str | None:
    """A regular file the harness wrote (its first `limit` bytes), or None if there is
    none. Not a symlink, FIFO or device: what the harness runs may be model-written,
    and must not make treadle read a host file or block on a pipe."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(limit).decode("utf-8", "replace")


__all__ = ["Harness", "HarnessEnv", "HarnessRun", "Score", "Verdict", "judge", "parse_command",
           "parse_reward", "run_harness"]

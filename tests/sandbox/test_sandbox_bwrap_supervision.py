"""The supervisor failing is the infrastructure's fault, not the command's (real bwrap).

A bwrap killed from outside, or one that fails before the command runs, must
raise SandboxSupervisorError from `exec` (a SandboxError: the trajectory is an
infrastructure failure, excluded from training), never come back as an
ExecResult that a reward would score. What the command does to itself, and what
treadle's own limits do to it, stay results.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest
import sandbox_probes as probes
from sandbox_helpers import SMALL, ended, marker, run, sleepers, wait_until

from treadle.envs.tools import PythonTool, ToolContext
from treadle.errors import SandboxError, SandboxSupervisorError
from treadle.sandbox import BwrapBackend, ExecResult
from treadle.types import Task

pytestmark = pytest.mark.integration


def _outer_bwrap_of(command: int) -> int:
    """The host pid of the bwrap that treadle started for the exec running `command`."""
    return probes.parent_of(probes.parent_of(command))


def test_a_supervisor_killed_from_outside_is_an_infrastructure_error(bwrap: BwrapBackend) -> None:
    tag = marker()

    async def body() -> None:
        async with await bwrap.start(SMALL) as sb:
            task = asyncio.ensure_future(sb.exec(["sleep", tag], timeout_s=10))
            await asyncio.to_thread(wait_until, lambda: sleepers(tag))
            outer = _outer_bwrap_of(sleepers(tag)[0])
            assert "bwrap" in probes.cmdline_of(outer)
            os.kill(outer, signal.SIGKILL)  # someone else's kill, not a limit of treadle's
            with pytest.raises(SandboxSupervisorError, match="signal 9"):
                await task
            after = await sb.exec(["echo", "still usable"], timeout_s=5)
            assert after.ok and after.stdout == "still usable\n"

    run(body())
    ended(lambda: sleepers(tag))  # the namespace died with its supervisor


def test_the_command_killing_itself_is_still_its_own_result(bwrap: BwrapBackend) -> None:
    async def body() -> ExecResult:
        async with await bwrap.start(SMALL) as sb:
            return await sb.exec(["sh", "-c", "kill -9 $$"], timeout_s=5)

    result = run(body())
    assert (result.exit_code, result.killed) == (None, "signal:9"), result


def test_a_supervisor_that_fails_before_the_command_is_an_infrastructure_error(
        work_root: str) -> None:
    backend = BwrapBackend(work_root=work_root, bounded_workdirs=False)

    async def body() -> None:
        async with await backend.start(SMALL) as sb:
            moved = sb.host_dir + ".moved"  # type: ignore[attr-defined]
            os.rename(sb.host_dir, moved)  # type: ignore[attr-defined]  # bwrap cannot bind it
            try:
                with pytest.raises(SandboxSupervisorError, match="before starting the command"):
                    await sb.exec(["true"], timeout_s=5)
            finally:
                shutil.rmtree(moved)

    run(body())


def test_a_tool_call_lets_the_supervisor_failure_through(bwrap: BwrapBackend) -> None:
    """Tools raise it (the agent loop then ends the trajectory as a tool-stage ERROR)."""
    tag = marker()

    async def body() -> None:
        async with await bwrap.start(SMALL) as sb:
            context = ToolContext(task=Task(task_id="t", prompt="p"), sandbox=sb)
            call = asyncio.ensure_future(PythonTool().call(
                {"code": f"import subprocess; subprocess.run(['sleep', '{tag}'])"}, context))
            await asyncio.to_thread(wait_until, lambda: sleepers(tag))
            os.kill(_outer_bwrap_of(probes.parent_of(sleepers(tag)[0])), signal.SIGKILL)
            with pytest.raises(SandboxError):
                await call

    run(body())

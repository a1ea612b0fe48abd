"""Run one command tree to completion: gate, capture with a cap, deadline, tree kill.

Every exec starts as `/bin/sh` running a tiny *gate* in a new session: it blocks
reading one line from its stdin until the host has moved it into the exec's
cgroups, then execs the real launcher (bwrap, or the local reaper), which inherits
the rest of stdin (the caller's input, or an immediate EOF). Nothing can fork
before it is inside the groups, so no process of the tree escapes the memory and
pids limits, and the gate needs neither a preexec_fn (unsafe with threads) nor root
inside the child. (stdin carries the go-ahead because dash cannot redirect from
descriptors above 9, and the free descriptor numbers of a host process are
unknown.) Before the exec the gate sets the launcher's own rlimits with `ulimit`
(`Launch.outer_rlimits`), so that the launcher and everything it starts, bwrap's
pid 1 included, inherit them. (The shell and not prlimit(2) from the host: a root
without CAP_SYS_RESOURCE may not set the limits of a process of another uid, and
another exec would cost time on every call.)

The host then reads stdout and stderr as they come, keeping at most
`max_output_bytes` in total, and waits for the launcher to exit. At the deadline,
when the output cap is hit, or when the awaiting task is cancelled, it calls the
backend's `kill_tree` and then waits for the tree to be gone; a cancelled exec
re-raises CancelledError only after that. Launchers guarantee that their exit
means the whole tree is dead (pid namespace teardown for bwrap, a subreaper for
local), so `run` returning means no process of the exec is left.

A launcher that reports its command's signals as statuses (bwrap) never dies of
a signal itself unless someone else sent it, and one that reports its command's
status (`Launch.status_fd`: bwrap's `--json-status-fd`) also tells a failure of
its own setup apart from the command's exit. In both cases `run` raises
SandboxSupervisorError instead of returning a result, since nothing the command
did is known (unless the memory limit killed something: that is the command's
doing and comes back as `killed="memory"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from treadle.errors import SandboxSupervisorError
from treadle.sandbox._cgroup import ExecCgroup
from treadle.sandbox.base import ExecResult, classify

log = logging.getLogger(__name__)

# "$@" is the launcher argv. `read` takes exactly one line (the shell reads a pipe
# byte by byte), leaving the caller's input to the launcher. Exit 125 (like `env`)
# if the host withdrew the go-ahead, so a half-set-up exec never runs.
_GATE = 'IFS= read -r go || exit 125; [ "$go" = go ] || exit 125; {limits}exec "$@"'
# `ulimit` flag and unit of each rlimit, as POSIX shells (dash, bash as sh) read them.
_ULIMIT = {resource.RLIMIT_CPU: ("-t", 1), resource.RLIMIT_FSIZE: ("-f", 512),
           resource.RLIMIT_NOFILE: ("-n", 1), resource.RLIMIT_CORE: ("-c", 512),
           resource.RLIMIT_AS: ("-v", 1024)}
_GO = b"go\n"
_DRAIN_GRACE_S = 1.0  # after exit, how long stragglers may keep the pipes open
_KILL_WAIT_S = 5.0  # after kill_tree, how long the launcher may take to exit


@dataclass(slots=True)
class Launch:
    """How to start one exec on the host."""

    argv: list[str]  # the launcher and its arguments (absolute path first)
    env: dict[str, str]  # the launcher's environment
    cwd: str  # the launcher's working directory on the host
    user: tuple[int, int] | None = None  # (uid, gid) to switch to before the gate runs
    pass_fds: tuple[int, ...] = ()  # extra fds the launcher reads (bwrap --args)
    signalled_by_status: bool = False  # the launcher reports signal N as status 128+N
    kill_tree: Callable[[int], None] = field(default=lambda pid: _killpg(pid))
    # (resource.RLIMIT_*, soft, hard) set on the launcher itself before it runs; only
    # those in _ULIMIT, values in whole units of `ulimit`
    outer_rlimits: tuple[tuple[int, int, int], ...] = ()
    # read end (non-blocking) of a pipe where the launcher writes JSON documents,
    # one of them {"exit-code": N} once the command has run (bwrap --json-status-fd)
    status_fd: int | None = None


def _killpg(pid: int) -> None:
    """SIGKILL the launcher's session leader process group (the gate made it leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class _ExecProtocol(asyncio.SubprocessProtocol):
    """Collects stdout/stderr (at most `cap` bytes over both) and reports the exit.

    Past the cap, data is read and discarded rather than left in the pipe: a
    writer blocked on a full pipe could not be told apart from a live one, and
    the pipes must reach EOF for the transport to finish.
    """

    def __init__(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        self.cap = cap
        self.out = bytearray()
        self.err = bytearray()
        self.used = 0
        self.truncated = False
        self.full: asyncio.Future[None] = loop.create_future()  # the cap was hit
        self.exited: asyncio.Future[None] = loop.create_future()  # the launcher exited
        self.finished: asyncio.Future[None] = loop.create_future()  # exited + pipes at EOF

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if self.truncated:
            return
        into = self.out if fd == 1 else self.err
        room = self.cap - self.used
        if len(data) > room:
            into += data[:room]
            self.used = self.cap
            self.truncated = True
            _resolve(self.full)
            return
        into += data
        self.used += len(data)

    def process_exited(self) -> None:
        _resolve(self.exited)

    def connection_lost(self, exc: Exception | None) -> None:
        _resolve(self.finished)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def run(
    launch: Launch,
    *,
    timeout_s: float,
    max_output_bytes: int,
    stdin: bytes | None,
    cgroup: ExecCgroup | None,
) -> ExecResult:
    """Run `launch` under the gate; see the module docstring. Cancellation-safe."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    uid, gid = launch.user if launch.user is not None else (None, None)
    try:
        transport, protocol = await _spawn(loop, launch, max_output_bytes, uid, gid)
    except BaseException:
        if cgroup is not None:
            await asyncio.shield(cgroup.remove())
        raise
    pid = transport.get_pid()
    own_kill: str | None = None
    try:
        if cgroup is not None:
            cgroup.attach(pid)
        # Only now may the tree start: the go-ahead, then the caller's input, then EOF.
        stdin_pipe = transport.get_pipe_transport(0)
        assert isinstance(stdin_pipe, asyncio.WriteTransport)
        stdin_pipe.write(_GO + (stdin or b""))
        stdin_pipe.close()  # after the buffer is flushed (or the reader is gone)
        done, _ = await asyncio.wait({protocol.exited, protocol.full}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if protocol.exited not in done:
            own_kill = "output_limit" if protocol.full in done else "timeout"
            await _stop(launch, pid, protocol.exited, cgroup)
        # The tree is gone; let the pipes deliver what they still hold.
        await asyncio.wait({protocol.finished}, timeout=_DRAIN_GRACE_S)
    except BaseException:
        # Cancelled (or failed): never leave the tree running. Shielded so that a
        # second cancellation cannot interrupt the cleanup halfway.
        await asyncio.shield(_stop(launch, pid, protocol.exited, cgroup))
        raise
    finally:
        returncode = transport.get_returncode()
        transport.close()
        oom = cgroup.oom_killed() if cgroup is not None else False
        if cgroup is not None:
            await asyncio.shield(cgroup.remove())
    if returncode is None:  # a launcher stuck in the kernel even after SIGKILL
        returncode = -signal.SIGKILL
    if launch.signalled_by_status and own_kill is None and not oom:
        # Such a launcher turns its command's signal into a status: its own death by a
        # signal is never the command's.
        reported = (returncode if launch.status_fd is None
                    else _reported_exit(launch.status_fd))
        _check_supervisor(returncode, reported, protocol.err)
    exit_code, killed = classify(
        returncode=returncode,
        signalled_by_status=launch.signalled_by_status,
        own_kill=own_kill,
        oom_killed=oom,
    )
    return ExecResult(
        exit_code=exit_code,
        stdout=protocol.out.decode("utf-8", "replace"),
        stderr=protocol.err.decode("utf-8", "replace"),
        timed_out=own_kill == "timeout",
        killed=killed,
        duration_s=loop.time() - started,
        truncated=protocol.truncated,
    )


def gate_script(outer_rlimits: tuple[tuple[int, int, int], ...]) -> str:
    """The gate, setting `outer_rlimits` before the exec (exit 125 if one fails)."""
    steps = []
    for res, soft, hard in outer_rlimits:
        flag, unit = _ULIMIT[res]
        # Soft first: a hard limit below the current soft one would be refused.
        for which, value in ([("-S ", soft), ("-H ", hard)] if soft != hard else [("", soft)]):
            if value == resource.RLIM_INFINITY:
                amount = "unlimited"
            elif value % unit:
                raise ValueError(f"rlimit {res}: {value} is not a whole number of {unit}")
            else:
                amount = str(value // unit)
            steps.append(f"ulimit {which}{flag} {amount} || exit 125; ")
    return _GATE.format(limits="".join(steps))


def _reported_exit(fd: int) -> int | None:
    """The exit code the launcher reported for its command, or None if it reported none."""
    data = bytearray()
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            data += chunk
    text = data.decode("utf-8", "replace")
    decoder = json.JSONDecoder()
    at = 0
    while (start := text.find("{", at)) >= 0:  # concatenated documents, any layout
        try:
            doc, at = decoder.raw_decode(text, start)
        except ValueError:
            return None
        if isinstance(doc, dict) and isinstance(doc.get("exit-code"), int):
            return int(doc["exit-code"])
    return None


def _check_supervisor(returncode: int, reported: int | None, stderr: bytearray) -> None:
    """Raise SandboxSupervisorError if the launcher, not its command, failed."""
    if returncode < 0:
        raise SandboxSupervisorError(
            f"the sandbox supervisor was killed by signal {-returncode} from outside the "
            "sandbox; the command's result is unknown")
    if reported is None:
        lines = stderr.decode("utf-8", "replace").strip().splitlines()
        raise SandboxSupervisorError(
            f"the sandbox supervisor exited with status {returncode} before starting the "
            f"command: {lines[-1] if lines else 'no message'}")


async def _spawn(loop: asyncio.AbstractEventLoop, launch: Launch, max_output_bytes: int,
                 uid: int | None, gid: int | None,
                 ) -> tuple[asyncio.SubprocessTransport, _ExecProtocol]:
    """Start the gate (blocked until the go-ahead) with the launcher's argv."""
    return await loop.subprocess_exec(
        lambda: _ExecProtocol(max_output_bytes, loop),
        "/bin/sh", "-c", gate_script(launch.outer_rlimits), "treadle-gate", *launch.argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=launch.pass_fds,
        start_new_session=True,
        env=launch.env,
        cwd=launch.cwd,
        user=uid,
        group=gid,
        extra_groups=None if launch.user is None else [],  # drop root's groups too
    )


async def _stop(launch: Launch, pid: int, exited: asyncio.Future[None],
                cgroup: ExecCgroup | None) -> None:
    """Kill the exec's tree and wait (bounded) until the launcher has exited."""
    if exited.done():
        return
    launch.kill_tree(pid)
    if cgroup is not None:
        await cgroup.kill_all()
    for attempt in range(2):
        try:
            await asyncio.wait_for(asyncio.shield(exited), _KILL_WAIT_S)
            return
        except TimeoutError:
            if attempt == 0:
                # The launcher ignored the polite kill (a wedged reaper): SIGKILL its group.
                log.error("sandbox launcher %d did not exit %.0fs after kill; SIGKILL", pid,
                          _KILL_WAIT_S)
                _killpg(pid)
    log.error("sandbox launcher %d survives SIGKILL; giving up on it", pid)

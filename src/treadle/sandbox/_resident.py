"""The host side of a sandbox's resident executor: one bwrap namespace kept for many calls.

A per-call bwrap exec builds namespaces, mounts, a gate shell and an interpreter
for every call (15-30 ms). A `ResidentExecutor` starts one bwrap launch per
sandbox, through the same gate, with the same options, seccomp filter, rlimits
and work dir, whose command (`--as-pid-1`) is the agent of `inside.agent`; a
call is then one message on a SOCK_SEQPACKET socket carrying a memfd with the
request, a memfd with the caller's stdin and two pipes the call writes its output
to, which the host reads directly (capped as in _process.py). The agent forks and
execs the call in the namespaces already built (or forks it from an idle
interpreter for `python3 -u -`), waits for it, kills and reaps whatever it left,
empties /tmp and /dev/shm; it answers with the call's wait status first, then
whether the sandbox is clean again.

What stays as it was per call: rlimits (every process of the tree holds them; a
forked call's CPU time starts at zero), the seccomp filter, namespaces, the file
system view, the environment (exactly the request's), the work dir, the wall
timeout and the output cap (enforced here: a `kill` message, then SIGKILL of the
whole launch if the agent does not answer within a grace period), and "nothing
outlives its exec" (the agent kills every process but itself and its zygote; with
a pids cgroup the host checks that only those are left and replaces the executor
otherwise). What differs, and is documented in docs/sandbox.md:

- One cgroup per executor, not per exec: `memory_mb` plus `HEADROOM_MB` for the
  executor itself, `max_processes` plus one (the zygote); a call's OOM kill is the
  group's oom_kill counter rising during it. Calls run one at a time per
  executor (a concurrent exec on the same sandbox takes the per-call path), so
  the group holds one call's tree at a time.
- The pid namespace, IPC namespace, /tmp and /dev/shm live as long as the
  executor; they are emptied after each call, and System V IPC objects left
  behind make the host replace the executor.

A call's result is what the call did: a timeout is `killed="timeout"`, and so on.
The executor dying during a call (killed from outside, crashed) raises
SandboxSupervisorError, unless treadle was killing the call anyway or the memory
limit fired; either way the next call starts a fresh executor. One that cannot
start at all makes its sandbox use per-call launches from then on (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treadle.errors import SandboxSupervisorError
from treadle.sandbox import _process, inside
from treadle.sandbox._cgroup import Cgroups, ExecCgroup
from treadle.sandbox._seccomp import memfd
from treadle.sandbox.base import ExecResult, Limits, classify

log = logging.getLogger(__name__)

PYTHON_ARGV = ("python3", "-u", "-")  # the python tool's command: served by the zygote
# Before a cell's own stderr when its session had to start again (the executor was
# replaced: its CPU budget, a call it could not clean up after, a kernel a cell
# tampered with), so that the model is told, as a notebook says "kernel restarted".
SESSION_RESTARTED = ("[treadle: the Python session was restarted before this cell; "
                     "what earlier cells defined is gone]\n")
HEADROOM_MB = 48  # the executor's own memory (bwrap, agent, zygote) above memory_mb
_READY_TIMEOUT_S = 20.0
_KILL_GRACE_S = 2.0  # after `kill`, how long the agent may take to answer
_EXIT_GRACE_S = 1.0  # after the agent's socket closes, how long bwrap may take to exit
_DRAIN_GRACE_S = 1.0
_TIDY_TIMEOUT_S = 10.0  # after a call's status: how long the agent may take to clean up
_STDERR_KEEP = 4096
_MAX_LEFT = 4  # outer bwrap, agent, zygote, its standby: all a cgroup holds between calls


_AGENT_MODULES = ("procs", "scratch", "agent")  # `inside`'s modules the agent is made of


def agent_command(python: str, sock_fd: int) -> list[str]:
    """The agent's command line: `inside.boot` with the agent's modules, then its
    arguments (the socket's fd, the zygote's source)."""
    modules = [part for name in _AGENT_MODULES for part in (name, inside.source(name))]
    return [python, "-I", "-S", "-c", inside.source("boot"), str(len(_AGENT_MODULES)),
            *modules, str(sock_fd), inside.source("zygote")]


@dataclass(slots=True)
class _Live:
    """One running executor."""

    launch: _process.Launch
    transport: asyncio.SubprocessTransport
    protocol: _process._ExecProtocol
    pid: int
    sock: socket.socket
    cgroup: ExecCgroup | None
    oom_kills: int = 0


class _Output:
    """stdout and stderr of one call, at most `cap` bytes together (as _ExecProtocol)."""

    def __init__(self, cap: int, loop: asyncio.AbstractEventLoop) -> None:
        self.cap, self.loop = cap, loop
        self.streams = (bytearray(), bytearray())
        self.used = 0
        self.truncated = False
        self.full: asyncio.Future[None] = loop.create_future()
        self.eof: asyncio.Future[None] = loop.create_future()
        self.open: list[int] = []

    def watch(self, fd: int, index: int) -> None:
        os.set_blocking(fd, False)
        self.open.append(fd)
        self.loop.add_reader(fd, self._readable, fd, index)

    def _readable(self, fd: int, index: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._close(fd)
                return
            if self.truncated:
                continue  # read and dropped: a writer blocked on a full pipe never ends
            room = self.cap - self.used
            self.streams[index].extend(data[:room])
            self.used += min(room, len(data))
            if len(data) > room:
                self.truncated = True
                _resolve(self.full)

    def _close(self, fd: int) -> None:
        if fd in self.open:
            self.loop.remove_reader(fd)
            self.open.remove(fd)
            os.close(fd)
        if not self.open:
            _resolve(self.eof)

    def close(self) -> None:
        for fd in list(self.open):
            self._close(fd)


class ResidentExecutor:
    """One sandbox's executor; `run` serves one call at a time (see `busy`).

    `launch(fd)` builds the bwrap launch whose command is the agent with socket `fd`.
    """

    def __init__(self, *, launch: Callable[[int], _process.Launch], limits: Limits,
                 cgroups: Cgroups | None) -> None:
        self._make_launch = launch
        self._limits = limits
        self._cgroups = cgroups
        self._live: _Live | None = None
        self._turn = asyncio.Lock()  # one call at a time; session cells queue for it
        self._queued = 0  # calls waiting for the turn
        self._cells = 0  # session cells answered: a new session after one is a restart
        self.broken = False  # could not start once: the sandbox uses per-call launches

    @property
    def busy(self) -> bool:
        """A call holds the executor or waits for it: another takes a per-call launch."""
        return self._turn.locked() or self._queued > 0

    async def run(self, argv: list[str], env: dict[str, str], timeout_s: float,
                  stdin: bytes | None, *, session: bool = False) -> ExecResult | None:
        """The call's result; None if the executor cannot start (use a per-call launch).

        `session`: `argv` is `python -u -` and `stdin` a cell of the sandbox's Python
        session (`Sandbox.run_cell`); it waits for its turn where a plain call would
        be refused while `busy`. Raises SandboxSupervisorError if the executor died
        during the call of something neither the call nor treadle did.
        Cancellation-safe: the call is killed (or the executor with it) before
        CancelledError propagates.
        """
        if self.busy and not session:
            raise RuntimeError("ResidentExecutor.run is not reentrant")
        self._queued += 1
        try:
            await self._turn.acquire()
        finally:
            self._queued -= 1
        try:
            if self._live is not None and self._live.protocol.exited.done():
                await self._discard(self._live)  # died between calls: start another
            if self._live is None:
                try:
                    self._live = await self._start()
                except SandboxSupervisorError as e:
                    self.broken = True
                    log.warning("sandbox executor cannot start (%s); this sandbox runs each "
                                "call in a bwrap launch of its own", e)
                    return None
            return await self._call(self._live, argv, env, timeout_s, stdin, session)
        finally:
            self._turn.release()

    async def cell(self, argv: list[str], env: dict[str, str], timeout_s: float,
                   code: bytes) -> ExecResult:
        """`run` of a session cell; SandboxSupervisorError if the executor cannot start."""
        result = await self.run(argv, env, timeout_s, code, session=True)
        if result is None:
            raise SandboxSupervisorError("the sandbox's resident executor cannot start, so "
                                         "it keeps no Python session (see the log)")
        return result

    async def close(self) -> None:
        """Kill the executor's whole namespace and wait until it is gone. Idempotent."""
        self.broken = True
        if self._live is not None:
            await self._discard(self._live)

    # -- one call -----------------------------------------------------------------

    async def _call(self, live: _Live, argv: list[str], env: dict[str, str], timeout_s: float,
                    stdin: bytes | None, session: bool) -> ExecResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        output = _Output(self._limits.max_output_bytes, loop)
        request = {"argv": argv, "env": env, "python": session or tuple(argv) == PYTHON_ARGV,
                   "session": session}
        theirs: list[int] = []
        try:
            theirs.append(memfd("treadle-request", json.dumps(request).encode()))
            theirs.append(memfd("treadle-stdin", stdin or b""))
            for index in (0, 1):
                read_end, write_end = os.pipe2(os.O_CLOEXEC)
                theirs.append(write_end)
                output.watch(read_end, index)
            live.sock.sendmsg([b"exec"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array("i", theirs))])
        except BaseException as e:
            output.close()
            await asyncio.shield(self._discard(live))
            if isinstance(e, OSError):  # the agent died just before the call
                raise SandboxSupervisorError(f"the sandbox executor is gone: {e}") from e
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        own_kill: str | None = None
        try:
            reply, own_kill = await self._wait(live, output, timeout_s)
            await asyncio.wait({output.eof}, timeout=_DRAIN_GRACE_S)
        finally:
            output.close()
        duration = loop.time() - started
        oom = self._oom_since_last(live)
        if reply is None:  # the agent is gone, or we killed the launch
            await self._discard(live)
            if own_kill is None and not oom:
                raise SandboxSupervisorError(_death_message(live))
            returncode = -9
        else:
            returncode = reply.status
            # The agent's clean-up comes after the status: if it fails, or the agent
            # dies doing it, the call's result stands and the next call gets a fresh one.
            tidy = await self._tidied(live)
            if (tidy is None or not tidy.clean or tidy.cpu_s > self._limits.cpu_s / 2
                    or (live.cgroup is not None and len(live.cgroup.pids()) > _MAX_LEFT)):
                await asyncio.shield(self._discard(live))  # a fresh one for the next call
        exit_code, killed = classify(returncode=returncode, signalled_by_status=False,
                                     own_kill=own_kill, oom_killed=oom)
        out, err = output.streams
        notice = ""
        if session and reply is not None:
            if reply.new_session and self._cells:
                notice = SESSION_RESTARTED
            self._cells += 1
        return ExecResult(exit_code=exit_code, stdout=out.decode("utf-8", "replace"),
                          stderr=notice + err.decode("utf-8", "replace"),
                          timed_out=own_kill == "timeout", killed=killed, duration_s=duration,
                          truncated=output.truncated)

    async def _wait(self, live: _Live, output: _Output, timeout_s: float,
                    ) -> tuple[_Reply | None, str | None]:
        """(the agent's answer or None if it died / was killed, why we stopped the call)."""
        loop = asyncio.get_running_loop()
        answer = asyncio.ensure_future(loop.sock_recv(live.sock, 4096))
        own_kill: str | None = None
        try:
            waits: set[asyncio.Future[Any]] = {answer, output.full, live.protocol.exited}
            done, _ = await asyncio.wait(waits,
                                         timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if answer not in done and not live.protocol.exited.done():
                own_kill = "output_limit" if output.full.done() else "timeout"
                await self._stop_call(live, answer)
        except BaseException:
            # Cancelled: the call must be gone before we re-raise. Shielded, so that a
            # second cancellation cannot leave it running.
            await asyncio.shield(self._stop_call(live, answer))
            raise
        finally:
            answer.cancel()
        if not answer.done() or answer.cancelled() or answer.exception() is not None:
            return None, own_kill
        return _parse(answer.result()), own_kill

    async def _tidied(self, live: _Live) -> _Tidy | None:
        """The agent's second answer (clean-up done); None if it died or took too long."""
        loop = asyncio.get_running_loop()
        answer = asyncio.ensure_future(loop.sock_recv(live.sock, 4096))
        try:
            waits: set[asyncio.Future[Any]] = {answer, live.protocol.exited}
            await asyncio.wait(waits, timeout=_TIDY_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await asyncio.shield(self._discard(live))  # cancelled: the state is unknown
            raise
        finally:
            answer.cancel()
        if not answer.done() or answer.cancelled() or answer.exception() is not None:
            return None
        return _parse_tidy(answer.result())

    async def _stop_call(self, live: _Live, answer: asyncio.Future[bytes]) -> None:
        """Ask the agent to kill the call; kill the whole launch if it does not answer."""
        with contextlib.suppress(OSError):
            live.sock.send(b"kill")
        waits: set[asyncio.Future[Any]] = {answer, live.protocol.exited}
        await asyncio.wait(waits, timeout=_KILL_GRACE_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if not answer.done() or answer.exception() is not None or not answer.result():
            await self._discard(live)

    def _oom_since_last(self, live: _Live) -> bool:
        if live.cgroup is None or "memory" not in live.cgroup.dirs:
            return False
        count = live.cgroup.oom_kills()
        fired, live.oom_kills = count > live.oom_kills, count
        return fired

    # -- lifecycle -------------------------------------------------------------------

    async def _start(self) -> _Live:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            launch = self._make_launch(theirs.fileno())
        except BaseException:
            ours.close()
            theirs.close()
            raise
        cgroup = None
        if self._cgroups is not None:
            cgroup = self._cgroups.create(dataclasses.replace(
                self._limits, memory_mb=self._limits.memory_mb + HEADROOM_MB,
                max_processes=self._limits.max_processes + 2))
        uid, gid = launch.user if launch.user is not None else (None, None)
        try:
            transport, protocol = await _process._spawn(loop, launch, _STDERR_KEEP, uid, gid)
        except BaseException:
            ours.close()
            if cgroup is not None:
                await asyncio.shield(cgroup.remove())
            raise
        finally:
            for fd in launch.pass_fds:
                if fd != theirs.fileno():
                    _close_quiet(fd)
            theirs.close()
        ours.setblocking(False)
        live = _Live(launch=launch, transport=transport, protocol=protocol,
                     pid=transport.get_pid(), sock=ours, cgroup=cgroup)
        try:
            if cgroup is not None:
                cgroup.attach(live.pid)
            stdin_pipe = transport.get_pipe_transport(0)
            assert isinstance(stdin_pipe, asyncio.WriteTransport)
            stdin_pipe.write(_process._GO)
            stdin_pipe.close()
            ready = asyncio.ensure_future(loop.sock_recv(ours, 64))
            try:
                waits: set[asyncio.Future[Any]] = {ready, protocol.exited}
                await asyncio.wait(waits, timeout=_READY_TIMEOUT_S,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()
            if not ready.done() or ready.cancelled() or ready.exception() or \
                    ready.result() != b"ready":
                await asyncio.wait({protocol.exited}, timeout=_EXIT_GRACE_S)
                raise SandboxSupervisorError(_start_message(live))
        except BaseException:
            await asyncio.shield(self._discard(live))
            raise
        return live

    async def _discard(self, live: _Live) -> None:
        """Kill the launch (the namespace dies with it), reap it, remove its groups."""
        if self._live is live:
            self._live = None
        await _process._stop(live.launch, live.pid, live.protocol.exited, live.cgroup)
        await asyncio.wait({live.protocol.finished}, timeout=_DRAIN_GRACE_S)
        live.transport.close()
        live.sock.close()
        if live.cgroup is not None:
            await live.cgroup.remove()


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int  # the call's exit code as os.waitstatus_to_exitcode gives it
    cpu_s: float  # the agent's own CPU time so far
    new_session: bool = False  # a session cell that found no session kernel and started one


@dataclass(frozen=True, slots=True)
class _Tidy:
    clean: bool  # the agent put the sandbox back as it was
    cpu_s: float  # the agent's own CPU time so far


def _parse(data: bytes) -> _Reply | None:
    """The agent's first answer, or None for EOF or anything malformed (it is in the sandbox)."""
    try:
        reply = json.loads(data)
    except ValueError:
        return None
    if not isinstance(reply, dict) or type(reply.get("status")) is not int \
            or not isinstance(reply.get("cpu_s"), int | float):
        return None
    return _Reply(status=reply["status"], cpu_s=float(reply["cpu_s"]),
                  new_session=reply.get("new_session") is True)


def _parse_tidy(data: bytes) -> _Tidy | None:
    """The agent's second answer; None for EOF or anything malformed."""
    try:
        reply = json.loads(data)
    except ValueError:
        return None
    if not isinstance(reply, dict) or not isinstance(reply.get("cpu_s"), int | float):
        return None
    return _Tidy(clean=reply.get("clean") is True, cpu_s=float(reply["cpu_s"]))


def _death_message(live: _Live) -> str:
    returncode = live.transport.get_returncode()
    if returncode is not None and returncode < 0:
        return (f"the sandbox supervisor was killed by signal {-returncode} from outside the "
                "sandbox; the command's result is unknown")
    return (f"the sandbox executor exited (status {returncode}) during the call: "
            f"{_last_line(live)}; the command's result is unknown")


def _start_message(live: _Live) -> str:
    return (f"the sandbox supervisor exited with status {live.transport.get_returncode()} "
            f"before starting the command: {_last_line(live)}")


def _last_line(live: _Live) -> str:
    lines = live.protocol.err.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _close_quiet(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)

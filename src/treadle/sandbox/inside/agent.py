"""The in-sandbox side of the resident executor: pid 1 of a bwrap sandbox, serving calls.

Run by `boot` with `procs` and `scratch` (the host passes their sources, since
treadle's checkout is hidden inside; standard library only), with the arguments FD
ZYGOTE, as the command of a `bwrap --as-pid-1` launch. FD is a SOCK_SEQPACKET socket
to the host, ZYGOTE the source of `zygote`. Per request it runs one call and answers
with its wait status, then makes the sandbox as it was:

- `exec`: fork, `setsid`, the caller's stdin (a memfd) and two pipes to the host as
  fds 0-2, the dispositions a fresh process has (SIGPIPE, SIGXFSZ, SIGINT default),
  every other fd closed, `execvpe` in the work dir with exactly the request's env.
- `python` (the python tool's `python3 -u -`): the same, but forked from a
  *zygote*, an interpreter started once (with that env, by the same PATH lookup)
  and kept idle, so a call skips the interpreter's start-up. The zygote forks an
  intermediate that forks the call and exits, so the call is this process's child
  (exact wait status, even if the call kills the zygote). Each call is a fresh
  process: nothing the code sets survives it, as with `python3 -`.
- `session` (`Sandbox.run_cell`): the zygote is a Python session's *kernel*, and
  a cell that ends keeps its process as the next kernel (`kept:` instead of exiting;
  see `zygote`); the old kernel is then killed like any other process. A
  fresh `python` call while a session lives is a plain exec.
- After every call: SIGKILL every process of the namespace but this one and the
  zygote until none is left, reap them, drop the zygote if the call stopped it or
  its standby, killed the standby, left it a child or changed its rlimits, nice or
  scheduling; send the call's status; then empty /tmp and /dev/shm (fresh per exec
  before; bounded, see `scratch`), unlink POSIX message queues, and
  send `clean` false (the host then replaces the executor) if that failed, System
  V IPC objects are left (they would hold memory across calls) or this process's
  own rlimits, nice or scheduling changed.

What protects this process from the calls it runs (same uid, same namespaces):
it is the namespace's init, so no process inside can signal it (the kernel drops
signals with default disposition sent to init from inside; it installs no
handler), /proc/1 is covered by bwrap.py's mount (and /proc/self of pid 1 resolves
there), it is non-dumpable, ptrace is denied by the seccomp filter, and calls
inherit none of its descriptors. The zygote is not init: a call can kill it (it is
then restarted) or, if it could reach the zygote's memory, tamper with later calls
of the same sandbox; it is non-dumpable for that reason. A call never learns more
than what `python3 -` would give it. This process holds the same rlimits as every
call (RLIMIT_CPU counts its own overhead too: it reports its CPU time and the host
replaces it well before the limit).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import sys
import time

from treadle.sandbox.inside import procs, scratch

_PR_SET_DUMPABLE = 4
_KILL_ROUNDS = 5000
_ZYGOTE_TIMEOUT_MS = 10_000
_ZYGOTE_POLL_MS = 200  # during a python call: how often to look for a stopped zygote


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None).prctl(option, value, 0, 0, 0)


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class Zygote:
    """An idle interpreter with a forked standby for the next `python3 -u -` call."""

    def __init__(self, program: str, env: dict[str, str], argv0: str, session: bool) -> None:
        self.env, self.argv0, self.session = env, argv0, session
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.chan = ours
        try:
            theirs.set_inheritable(True)
            # -s and no PYTHONPATH: see `zygote`; the call gets both back
            # after the fork.
            own_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
            spawned = procs.spawn([argv0, "-s", "-u", "-c", program, str(theirs.fileno()),
                                   json.dumps(env), *(["session"] if session else [])],
                                  own_env, [procs.devnull()] * 3)
        finally:
            theirs.close()
        if isinstance(spawned, str):
            ours.close()
            raise OSError(errno.ENOENT, spawned)
        self.pid = spawned
        self.pidfd = os.pidfd_open(self.pid)
        self.standby: int | None = None
        self.suspect = False  # a call stopped it: replaced after that call
        reply = self.chan.recv(64) if self._readable(_ZYGOTE_TIMEOUT_MS) else b""
        if not reply.startswith(b"ready:"):
            self.stop()
            raise OSError(errno.ECHILD, "the python zygote did not start")
        self.standby = int(reply[6:])
        self.settings = procs.settings(self.pid)  # what the standby and later ones must keep

    def _readable(self, timeout_ms: int) -> bool:
        poller = select.poll()
        poller.register(self.chan, select.POLLIN)
        return bool(poller.poll(timeout_ms))

    def adopt(self, call: int, standby: int) -> bool:
        """A session's cell `call` is its kernel now, the old one left to be killed;
        False (nothing changed) if the cell has died since it said so."""
        try:
            pidfd = os.pidfd_open(call)
        except ProcessLookupError:
            return False
        os.close(self.pidfd)
        self.pid, self.pidfd, self.standby = call, pidfd, standby
        return True

    def stop(self) -> None:
        self.chan.close()
        os.close(self.pidfd)
        for pid in (self.pid, self.standby):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


class Resident:
    """The request loop; see the module docstring."""

    def __init__(self, fd: int, zygote_program: str) -> None:
        self.zygote_program = zygote_program  # `zygote`'s source
        self.host = socket.socket(fileno=fd)
        self.host.set_inheritable(False)
        self.zygote: Zygote | None = None
        self.new_session = False  # this call's session kernel was started for it
        self.settings = procs.settings(0)  # rlimits, nice, scheduling: no call may change them

    def serve(self) -> None:
        self.host.send(b"ready")
        while True:
            msg, fds, _, _ = socket.recv_fds(self.host, 16, 4)
            if not msg:
                return  # the host is gone
            if msg != b"exec" or len(fds) != 4:
                for fd in fds:
                    os.close(fd)
                continue  # a stale `kill` for a call that had already finished
            request_fd, *stdio = fds
            try:
                request = json.loads(procs.read_all(request_fd))
            finally:
                os.close(request_fd)
            try:
                status, stop = self.call(request, stdio)
            finally:
                for fd in stdio:
                    os.close(fd)
            # The call's status as soon as its processes are gone (they hold its output
            # pipes), then whether the rest of the clean-up worked: if this process
            # dies doing it (its RLIMIT_CPU), the host still has the call's result.
            settled = self.settle()
            self.host.send(json.dumps({"status": status, "cpu_s": round(_cpu_s(), 4),
                                       "new_session": self.new_session}).encode())
            self.new_session = False
            clean = self.tidy() and settled
            self.host.send(json.dumps({"clean": clean, "cpu_s": round(_cpu_s(), 4)}).encode())
            if stop:
                return

    def call(self, request: dict[str, object], stdio: list[int]) -> tuple[int, bool]:
        """(the call's exit code as `waitstatus_to_exitcode` gives it, host gone)."""
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        env = {str(k): str(v) for k, v in request["env"].items()}  # type: ignore[attr-defined]
        for fd in stdio:
            os.set_inheritable(fd, False)  # SCM_RIGHTS fds arrive inheritable
        session = bool(request.get("session"))
        # A session's cell never runs as a plain exec while a kernel can be started:
        # one whose kernel is gone (killed between calls) runs in a fresh one.
        for _ in range(2 if session else 1):
            zygote = self.python(argv[0], env, session) if request.get("python") else None
            if zygote is None:
                break
            try:
                socket.send_fds(zygote.chan, [b"run"], stdio)
            except OSError:
                self.drop_zygote()
                continue
            result = self.wait_zygote(zygote)
            if result is not None:
                return result
            os.lseek(stdio[0], 0, os.SEEK_SET)  # the stdin memfd, from its start again
        spawned = procs.spawn(argv, env, stdio)
        if isinstance(spawned, str):
            os.write(stdio[2], spawned.encode())
            return (127 if "No such file" in spawned else 126), False
        return self.wait(spawned)

    def wait(self, pid: int) -> tuple[int, bool]:
        """Wait for our child `pid`, serving `kill` from the host."""
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        poller.register(self.host, select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        stop = False
        try:
            while True:
                for fd, _ in poller.poll():
                    if fd == pidfd:
                        _, status = os.waitpid(pid, 0)
                        return os.waitstatus_to_exitcode(status), stop
                    stop = self.on_host(poller) or stop
        except ChildProcessError:  # reaped by the zygote, which then died before telling
            return -signal.SIGKILL, stop
        finally:
            os.close(pidfd)

    def on_host(self, poller: select.poll) -> bool:
        """A message from the host during a call: `kill` (timeout, cap, cancel) or EOF."""
        gone = not self.host.recv(16)
        if gone:
            poller.unregister(self.host)
        self.kill_others()
        return gone

    def wait_zygote(self, zygote: Zygote) -> tuple[int, bool] | None:
        """Wait for a call the zygote's standby runs; None if it never started."""
        poller = select.poll()
        for fd in (self.host, zygote.chan, zygote.pidfd):
            poller.register(fd, select.POLLIN)
        call: int | None = None
        stop = killing = False  # killing: the host asked us to kill this call
        while True:
            events = poller.poll(_ZYGOTE_POLL_MS)
            stopped = [p for p in (zygote.pid, zygote.standby)
                       if p is not None and procs.state(p) in ("T", "t")]
            if not events and stopped:
                # Stopped by the call (a stop signal from its own code), or the standby
                # by one before it: neither could go on. Continue them; the zygote is
                # replaced after this call.
                zygote.suspect = True
                for pid in stopped:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            # The zygote's words first: a cell's `kept:` that came with a `kill` or its
            # kernel's death is what the cell did before either.
            for fd, _ in sorted(events, key=lambda event: event[0] != zygote.chan.fileno()):
                if fd == self.host.fileno():
                    stop = self.on_host(poller) or stop
                    killing = True
                    continue
                msg = zygote.chan.recv(64) if fd == zygote.chan.fileno() else b""
                if msg.startswith(b"pid:"):
                    call, zygote.standby = int(msg[4:]), None  # the standby is the call now
                    if killing:  # asked before we knew the call: kill it now
                        self.kill_others()
                elif msg.startswith(b"kept:") and killing:
                    continue  # killed as it ended: its kernel reports how it died
                elif msg.startswith(b"kept:") and call is not None and zygote.session:
                    status, standby = _status_next(msg)
                    if zygote.adopt(call, standby):
                        return status, stop
                    # It died just after: its kernel reports how.
                elif msg.startswith(b"status:"):
                    status, standby = _status_next(msg)
                    zygote.standby = standby or None
                    if zygote.standby is None:
                        self.drop_zygote()  # it spent its CPU budget: a fresh one next time
                    if call is not None:
                        return status, stop
                    if self.zygote is None:
                        return None
                    # The standby died before taking the call; the next one takes it.
                else:  # the zygote died: its call, if any, is now our child
                    # Once the zygote has exited its children are ours: the socket's
                    # EOF comes earlier, while a finished call may still be its zombie.
                    select.select([zygote.pidfd], [], [], _ZYGOTE_TIMEOUT_MS / 1000)
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(zygote.pid, os.WNOHANG)
                    if zygote.session and call is not None:
                        # A cell that outlives its kernel ends the session with its own
                        # status: its `kept:` if sent before we stop reading, else its
                        # exit (its `kept:` fails from then on, and it exits with it).
                        with contextlib.suppress(OSError):
                            zygote.chan.shutdown(socket.SHUT_RD)
                        kept = _kept_status(zygote.chan)
                        if kept is not None:
                            self.drop_zygote()
                            return kept, stop
                    self.drop_zygote()
                    if call is None:
                        return None
                    status_and_stop = self.wait(call)
                    return status_and_stop[0], stop or status_and_stop[1]

    def python(self, argv0: str, env: dict[str, str], session: bool) -> Zygote | None:
        zygote = self.zygote
        if zygote is not None and zygote.session and not session:
            return None  # a fresh interpreter beside the session: a plain exec
        if zygote is not None and (zygote.env, zygote.argv0, zygote.session) != (
                env, argv0, session):
            self.drop_zygote()
        if self.zygote is None:
            try:
                self.zygote = Zygote(self.zygote_program, env, argv0, session)
                self.new_session = session
            except OSError:
                return None  # no such interpreter, say: the plain exec reports it
        return self.zygote

    def drop_zygote(self) -> None:
        if self.zygote is not None:
            self.zygote.stop()
            self.zygote = None

    def _keep(self) -> set[int]:
        if self.zygote is None:
            return {1}
        return {1, self.zygote.pid, *([self.zygote.standby] if self.zygote.standby else [])}

    def kill_others(self) -> list[int]:
        """SIGKILL every process of the namespace but ours; the pids signalled."""
        keep = self._keep()
        others = [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) not in keep]
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return others

    def settle(self) -> bool:
        """Kill and reap every process of the call; drop a zygote it tampered with."""
        for _ in range(2):
            for _ in range(_KILL_ROUNDS):
                self.check_zygote()
                if not self.kill_others():
                    break
                self.reap()
                time.sleep(0.0002)  # let SIGKILLed processes finish exiting
            else:
                return False
            self.reap()
            zygote = self.zygote
            if zygote is None or (procs.children(zygote.pid) == {zygote.standby}
                                  and procs.settings(zygote.pid) == zygote.settings
                                  and procs.settings(zygote.standby) == zygote.settings):
                return True
            # More children than its standby (a call's clone(CLONE_PARENT)), or rlimits,
            # nice or scheduling changed: a fresh zygote next time; kill what is left.
            self.drop_zygote()
        return False

    def check_zygote(self) -> None:
        """Drop the zygote unless it idles as it should: standby alive, nobody stopped.

        Between calls it sends nothing; a message means its standby died (killed by
        the call), and it has forked another we do not know of: the pids we keep would
        be stale, and each round would kill the standby it forks anew.
        """
        zygote = self.zygote
        if zygote is None:
            return
        pending = select.poll()
        pending.register(zygote.chan, select.POLLIN)
        if (zygote.suspect or zygote.standby is None or pending.poll(0)
                or procs.state(zygote.pid) not in procs.IDLE
                or procs.state(zygote.standby) not in procs.IDLE):
            self.drop_zygote()  # SIGKILL works on stopped processes too

    def tidy(self) -> bool:
        """Empty the scratch dirs, check IPC objects and our settings; True if clean."""
        return scratch.tidy() and procs.settings(0) == self.settings

    def reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.zygote is not None and pid == self.zygote.pid:
                self.drop_zygote()  # it died (killed from outside, or spent its CPU)


def _kept_status(chan: socket.socket) -> int | None:
    """The status of a `kept:` waiting on `chan`, if one is; the rest is dropped."""
    while True:
        try:
            msg = chan.recv(64, socket.MSG_DONTWAIT)
        except OSError:
            return None
        if not msg:
            return None
        if msg.startswith(b"kept:"):
            return _status_next(msg)[0]


def _status_next(msg: bytes) -> tuple[int, int]:
    """(status, standby) of the zygote's ``status:S next:N`` or a cell's ``kept:S next:N``."""
    status, _, standby = msg.partition(b":")[2].partition(b" next:")
    return int(status), int(standby)


def main() -> None:
    """`boot`'s entry: FD ZYGOTE in sys.argv."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # init: no handler, so no signal from inside
    _prctl(_PR_SET_DUMPABLE, 0)
    Resident(int(sys.argv[1]), sys.argv[2]).serve()


"""The local backend's supervisor: rlimits, then the command, then nothing left behind.

Run as a script (`python -I -S reaper.py SPEC -- ARGV...`; standard library only,
so it runs without site-packages). It makes itself a *child subreaper*
(PR_SET_CHILD_SUBREAPER), so every process the command starts stays its
descendant even after `setsid` and double forks: orphans are re-parented to it
rather than to init. It forks the command with the rlimits of SPEC applied and,
when the command exits or the reaper gets SIGTERM/SIGHUP/SIGINT (its parent dying
sends SIGTERM too: PR_SET_PDEATHSIG), SIGKILLs every descendant, repeating until
none is left, and reaps them. Then it exits the way the command did: same status,
or the same signal re-raised on itself, so the host reads an exact wait status.

SPEC is comma-separated `NAME=SOFT:HARD` items, NAME as in `resource.RLIMIT_NAME`.

What it cannot catch: a descendant that escapes the tree by other means than
re-parenting (ptrace tricks, or another subreaper that then exits), and anything a
process does outside itself (files, other users' processes) - this is a
development backend, not isolation.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_EXEC_FAILED = 127
_MAX_KILL_ROUNDS = 2000
_WAITED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGINT}


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def parse_spec(spec: str) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) triples from SPEC."""
    out: list[tuple[int, int, int]] = []
    for item in filter(None, spec.split(",")):
        name, _, values = item.partition("=")
        soft, _, hard = values.partition(":")
        out.append((getattr(resource, f"RLIMIT_{name}"), int(soft), int(hard)))
    return out


def format_spec(rlimits: list[tuple[str, int, int]]) -> str:
    return ",".join(f"{name}={soft}:{hard}" for name, soft, hard in rlimits)


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of `root`, from one scan of /proc."""
    children: dict[int, list[int]] = {}
    zombies: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = data.rpartition(b")")[2].split()
        pid = int(name)
        if fields[0] == b"Z":
            zombies.add(pid)
        children.setdefault(int(fields[1]), []).append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            stack.append(child)
            if child not in zombies:
                found.append(child)
    return found


def _reap_nohang() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants() -> None:
    """SIGKILL every descendant until none is left; reap them all."""
    me = os.getpid()
    for _ in range(_MAX_KILL_ROUNDS):
        pids = descendants(me)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap_nohang()
        time.sleep(0.001)
    # Block until every child is reaped; all were SIGKILLed, so this ends promptly.
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _exit_like(status: int | None) -> None:
    if status is None:
        os._exit(128 + signal.SIGTERM)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be handled anyway
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # only if the signal did not end us (cannot happen for kills)
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: reaper.py SPEC -- ARGV...\n")
        os._exit(2)
    rlimits, command = parse_spec(argv[1]), argv[3:]
    # Signals are blocked and taken synchronously with sigwaitinfo: no handler can
    # interrupt the cleanup halfway, and none is lost while we are busy.
    original_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.getppid() == 1:  # the host died before PDEATHSIG was armed
        os._exit(128 + signal.SIGTERM)
    child = os.fork()
    if child == 0:
        _run_child(command, rlimits, original_mask)
    status: int | None = None
    stopped = False
    while status is None and not stopped:
        info = signal.sigwaitinfo(_WAITED)
        if info.si_signo != signal.SIGCHLD:
            stopped = True  # told to stop (or the host died): kill everything
            break
        while True:  # reap every exited child: the command, or re-parented orphans
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                stopped = True
                break
            if pid == 0:
                break
            if pid == child:
                status = wait_status
    kill_descendants()
    _exit_like(status)


def _run_child(command: list[str], rlimits: list[tuple[int, int, int]],
               mask: set[int | signal.Signals]) -> None:
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"treadle-sandbox: cannot run {command[0]!r}: {e.strerror}\n")
    except BaseException as e:
        sys.stderr.write(f"treadle-sandbox: cannot run {command[0]!r}: {e}\n")
    finally:
        os._exit(_EXEC_FAILED)


if __name__ == "__main__":
    main(sys.argv)

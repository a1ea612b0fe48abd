"""How the resident agent (`agent`) starts a call's process and reads the processes of
its namespace: their state, children and the settings no call may change.

Inside the sandbox, loaded with the agent (standard library only; see `boot`).
"""

from __future__ import annotations

import errno
import os
import resource
import signal

# What a process started by a shell has: Python ignores SIGPIPE and SIGXFSZ.
DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT)


_NULL: list[int] = []


def devnull() -> int:
    if not _NULL:
        _NULL.append(os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC))
    return _NULL[0]


IDLE = ("S", "R", "D")  # what /proc/PID/stat may say of an idle zygote or standby


# SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU: a stop sent and not yet taken still stops it.
_STOPS = sum(1 << (int(s) - 1) for s in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN,
                                         signal.SIGTTOU))


def state(pid: int | None) -> str | None:
    """The state letter of /proc/PID/stat ("T" also for a stop signal pending, which
    a loaded machine may not have delivered yet), None if there is no such process."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & _STOPS:
            return "T"
    return stat[stat.rindex(b")") + 2:][:1].decode()


def children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return {int(n) for n in f.read().split()}
    except (OSError, ValueError):
        return set()


_RLIMITS = tuple(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))


def settings(pid: int | None) -> tuple[object, ...] | None:
    """What a process hands its children that a same-uid process could change from
    outside: rlimits, nice, scheduling policy, priority, CPU affinity; 0 is us."""
    if pid is None:
        return None
    try:
        return (tuple(resource.prlimit(pid, r) for r in _RLIMITS),
                os.getpriority(os.PRIO_PROCESS, pid), os.sched_getscheduler(pid),
                os.sched_getparam(pid).sched_priority, frozenset(os.sched_getaffinity(pid)))
    except OSError:
        return None


def spawn(argv: list[str], env: dict[str, str], stdio: list[int]) -> int | str:
    """posix_spawn (vfork: no page-table copy) with `env`'s PATH; the pid or an error line.

    Like execvp: every PATH entry is tried, EACCES remembered. A fresh session and
    default dispositions for what Python ignores; every fd of ours is close-on-exec.
    """
    name = argv[0]
    paths = [name] if "/" in name else [os.path.join(d or ".", name)
                                        for d in os.get_exec_path(env)]
    error: OSError | None = None
    for path in paths:
        try:
            return os.posix_spawn(
                path, argv, env, setsid=True, setsigdef=DEFAULT_SIGNALS,
                file_actions=[(os.POSIX_SPAWN_DUP2, fd, target)
                              for target, fd in enumerate(stdio)])
        except OSError as e:
            if error is None or e.errno not in (errno.ENOENT, errno.ENOTDIR):
                error = e  # the last telling error, as execvp reports it
    reason = error.strerror if error is not None else "No such file or directory"
    return f"treadle-sandbox: cannot run {name!r}: {reason}\n"


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)

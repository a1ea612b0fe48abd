"""The resident agent's clean-up of what a call leaves in the namespace it shares with
the next: the scratch dirs (/tmp, /dev/shm: fresh per exec with per-call launches),
POSIX message queues, and the check that no System V IPC object was left (they
would hold memory across calls; the host then replaces the executor). What bwrap.py
mounted in a scratch dir (an `expose` path under /tmp) stays, with the dirs that
lead to it.

Run inside the sandbox as part of the agent (`agent`; loaded by `boot` from the
source the host passes, standard library only); only called once every process of
the call is dead, so nothing races the walks.
"""

from __future__ import annotations

import errno
import os

SCRATCH = ("/tmp", "/dev/shm")
_IPC = ("/proc/sysvipc/shm", "/proc/sysvipc/msg", "/proc/sysvipc/sem")
_MQUEUE = "/dev/mqueue"  # the IPC namespace's POSIX message queues (mounted by bwrap.py)
# Emptying the scratch dirs costs the agent CPU time (RLIMIT_CPU, like a call's):
# past this many inodes (links count: tmpfs charges each) or entries, the host
# replaces the executor instead (a fresh namespace costs one start, ~50 ms).
MAX_ENTRIES = 20_000


def tidy() -> bool:
    """Empty the scratch dirs and the message queues; True if done and no System V
    IPC object is left."""
    clean = True
    for top in SCRATCH:
        clean = _empty(top) and clean
    for path in _IPC:
        try:
            with open(path, "rb") as f:
                clean = clean and len(f.read().splitlines()) <= 1
        except OSError:
            pass
    try:
        for name in os.listdir(_MQUEUE):  # POSIX message queues: data across calls
            os.unlink(os.path.join(_MQUEUE, name))
    except FileNotFoundError:
        pass  # no mqueue mount: bwrap.py always makes one
    except OSError:
        clean = False
    return clean


def _empty(top: str) -> bool:
    """Remove everything under `top` (a call may leave read-only dirs); True if done.

    Only called once every process of the call is dead, so nothing races the walk.
    """
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return True  # no such scratch dir in this sandbox
    try:
        vfs = os.fstatvfs(fd)
        if vfs.f_files and vfs.f_files - vfs.f_ffree > MAX_ENTRIES:
            return False  # not worth the CPU time: a fresh executor instead
        _empty_fd(fd, os.fstat(fd).st_dev, [MAX_ENTRIES])
        return True  # each entry removed, or kept as a mount: the walk raises otherwise
    except (OSError, RecursionError):  # the host replaces the executor
        return False
    finally:
        os.close(fd)


def _empty_fd(dir_fd: int, device: int, budget: list[int]) -> bool:
    """Remove what is under `dir_fd` but the mounts of another file system than
    `device` (exposed host paths that bwrap.py mounts under /tmp) and the dirs that
    lead to them; True if something was kept. Raises OSError if anything else stays."""
    entries = []
    with os.scandir(dir_fd) as listing:
        for entry in listing:
            budget[0] -= 1
            if budget[0] < 0:
                raise OSError(errno.E2BIG, "too many entries to clean")
            entries.append(entry)
    kept = False
    for entry in entries:
        if entry.stat(follow_symlinks=False).st_dev != device:
            kept = True  # a mount: no call can make one (no capability inside)
            continue
        if not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.name, dir_fd=dir_fd)
            continue
        os.chmod(entry.name, 0o700, dir_fd=dir_fd)  # a dir, and no process left to swap it
        sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            inner = _empty_fd(sub, device, budget)
        finally:
            os.close(sub)
        if inner:
            kept = True
        else:
            os.rmdir(entry.name, dir_fd=dir_fd)
    return kept

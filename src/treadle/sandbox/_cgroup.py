"""Per-exec cgroup v1 memory and pids limits, where the host lets us write them.

rlimits bound one process each; a cgroup bounds a whole process tree, whatever it
forks, and (unlike RLIMIT_NPROC) also binds host root. Each exec gets its own
child group under the *caller's own* cgroup in each hierarchy, so the caller's
limits and accounting still cover its sandboxes (nesting never escapes them).

Only cgroup v1 is supported: cgroup v2 needs a delegated subtree with no processes
of its own, which a service cannot assume. Where a controller is missing or not
writable the exec runs without it, and that is logged once (info): memory is then
bounded per process by RLIMIT_AS only and the process count by RLIMIT_NPROC only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field

from treadle.sandbox.base import MIB, Limits

log = logging.getLogger(__name__)

GROUP_DIR = "treadle-sandbox"  # our parent group inside the caller's own group
_CONTROLLERS = ("memory", "pids")


@dataclass(slots=True)
class ExecCgroup:
    """The groups of one exec: controller name -> directory."""

    dirs: dict[str, str] = field(default_factory=dict)

    def attach(self, pid: int) -> None:
        """Move `pid` into every group; a controller that refuses is dropped (logged)."""
        for name, path in list(self.dirs.items()):
            try:
                _write(os.path.join(path, "cgroup.procs"), str(pid))
            except OSError as e:
                log.warning("cgroup %s: cannot attach pid %d (%s); running without it",
                            name, pid, e.strerror)
                _rmdir_quiet(path)
                del self.dirs[name]

    def oom_killed(self) -> bool:
        """True if the kernel OOM-killed a process of this exec (memory limit hit)."""
        path = self.dirs.get("memory")
        if path is None:
            return False
        try:
            with open(os.path.join(path, "memory.oom_control")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value) > 0
        except (OSError, ValueError):
            pass
        return False

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.dirs.values():
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    found.update(int(line) for line in f if line.strip())
            except OSError:
                continue
        return found

    async def kill_all(self, rounds: int = 200) -> None:
        """SIGKILL every process in the groups until none is left (a fork bomb may race)."""
        for _ in range(rounds):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.005)
        log.error("cgroup still has processes after %d kill rounds: %s", rounds, self.dirs)

    async def remove(self) -> None:
        """Kill what is left and delete the groups (retrying while exits finish)."""
        await self.kill_all()
        for path in self.dirs.values():
            for _ in range(200):
                if _try_rmdir(path):
                    break
                await asyncio.sleep(0.01)
        self.dirs.clear()


class CgroupV1:
    """Makes per-exec groups under the caller's own v1 groups. Use `detect_cgroups()`."""

    def __init__(self, bases: dict[str, str]) -> None:
        self.bases = bases  # controller -> our parent group directory

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.bases))

    def sweep(self) -> None:
        """Remove empty groups whose owner process is dead (a crash skips their removal)."""
        for base in self.bases.values():
            _sweep(base)

    def create(self, limits: Limits) -> ExecCgroup:
        """A fresh group per controller with the limits set; failures drop that controller."""
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        group = ExecCgroup()
        for controller, base in self.bases.items():
            path = os.path.join(base, name)
            try:
                os.mkdir(path)
                if controller == "memory":
                    limit = str(limits.memory_mb * MIB)
                    _write(os.path.join(path, "memory.limit_in_bytes"), limit)
                    memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
                    if os.path.exists(memsw):  # absent without swap accounting
                        _write(memsw, limit)  # or the tree could page out past the limit
                else:
                    _write(os.path.join(path, "pids.max"), str(limits.max_processes))
            except OSError as e:
                log.warning("cgroup %s: cannot set up %s (%s); running without it",
                            controller, path, e.strerror)
                _rmdir_quiet(path)
                continue
            group.dirs[controller] = path
        return group


@functools.cache
def detect_cgroups() -> CgroupV1 | None:
    """The writable v1 controllers of this process, or None. Probed once, logged once."""
    bases: dict[str, str] = {}
    own = _own_groups()
    mounts = _v1_mounts()
    for controller in _CONTROLLERS:
        if controller not in own or controller not in mounts:
            continue
        mount_point, mount_root = mounts[controller]
        # /proc/self/cgroup paths are relative to the hierarchy root; the mount may
        # show only a subtree of it (containers), rooted at mount_root.
        rel = os.path.relpath(own[controller], mount_root)
        base = os.path.normpath(os.path.join(mount_point, rel, GROUP_DIR))
        try:
            os.makedirs(base, exist_ok=True)
            if not os.access(os.path.join(base, "cgroup.procs"), os.W_OK):
                raise PermissionError(errno.EACCES, "cgroup.procs not writable")
        except OSError as e:
            log.info("cgroup v1 %s controller not usable at %s: %s", controller, base, e)
            continue
        bases[controller] = base
    missing = [c for c in _CONTROLLERS if c not in bases]
    if missing:
        log.info("sandbox cgroup limits unavailable for %s: memory is bounded per process "
                 "by RLIMIT_AS and processes by RLIMIT_NPROC only (not enforced for root)",
                 ", ".join(missing))
    return CgroupV1(bases) if bases else None


def _own_groups() -> dict[str, str]:
    """controller -> this process's group path, from /proc/self/cgroup (v1 lines only)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _id, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(","):
                    if c:
                        out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _v1_mounts() -> dict[str, tuple[str, str]]:
    """controller -> (mount point, mount root) of its v1 hierarchy, from mountinfo."""
    out: dict[str, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != "cgroup":
            continue
        options = tail[2].split(",")
        for controller in _CONTROLLERS:
            if controller in options and controller not in out:
                out[controller] = (_unescape(fields[4]), _unescape(fields[3]))
    return out


def _unescape(path: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _sweep(base: str) -> None:
    """Remove empty groups left by dead owners (a crash skips ExecCgroup.remove)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid_text = name.split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _remove_dead_group(os.path.join(base, name))


def _remove_dead_group(path: str, attempts: int = 50) -> None:
    """Kill what is left in a dead owner's group and remove it. Its processes may
    still be exiting, so this retries for up to half a second; a group that
    outlasts that is left for the next sweep."""
    for _ in range(attempts):
        if _try_rmdir(path):
            return
        with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
            for line in f:
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(line), signal.SIGKILL)
        time.sleep(0.01)


def _try_rmdir(path: str) -> bool:
    """Remove an empty group; False while the kernel says it is busy (processes
    still exiting). Any other failure is logged and counts as done."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno == errno.EBUSY:
            return False
        log.warning("cannot remove cgroup %s: %s", path, e.strerror)
    return True


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _rmdir_quiet(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)

"""Per-exec cgroup memory and pids limits (v1 or v2), where the host lets us write them.

rlimits bound one process each; a cgroup bounds a whole process tree, whatever it
forks, and (unlike RLIMIT_NPROC) also binds host root. Each exec gets its own
child group under the *caller's own* cgroup, so the caller's limits and accounting
still cover its sandboxes (nesting never escapes them).

- **cgroup v1** (a hierarchy per controller): a group per exec in the memory and the
  pids hierarchy, under ``treadle-sandbox`` in the caller's own group of each
  (``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes``, ``pids.max``).
- **cgroup v2** (the unified hierarchy, what most hosts have now): one group per
  exec holding both controllers (``memory.max``, ``memory.swap.max`` 0, ``pids.max``;
  OOM kills counted in ``memory.events``), under ``treadle-sandbox`` in the caller's
  own group. v2 lets a group hand controllers to its children only while it holds
  no process itself, so the caller's group must be delegated to it (writable) and
  the caller must be alone in it: treadle then moves itself into a leaf of that
  group, ``treadle-service``, enables memory and pids below it and makes its exec
  groups beside that leaf. A treadle process started later inside that leaf (a
  sandbox server the service runs) finds the layout and shares it. Run treadle
  alone in a group delegated to it: ``systemd-run -p Delegate=yes ...``, a unit with
  ``Delegate=yes``, or a container whose cgroup namespace is its own with treadle as
  its only process. A group that holds other processes is left as it is (logged).

v1 is used where it offers the memory controller (hybrid hosts), else v2 where it
does. Where no controller is usable the exec runs without it, and that is logged
once (info): memory is then bounded per process by RLIMIT_AS only and the process
count by RLIMIT_NPROC only.
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
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from treadle.sandbox.base import MIB, Limits

log = logging.getLogger(__name__)

GROUP_DIR = "treadle-sandbox"  # our parent group inside the caller's own group
SERVICE_LEAF = "treadle-service"  # v2: where treadle moves itself (see the docstring)
_CONTROLLERS = ("memory", "pids")
PROC_CGROUP = "/proc/self/cgroup"
MOUNTINFO = "/proc/self/mountinfo"


@dataclass(slots=True)
class ExecCgroup:
    """The groups of one exec: controller name -> directory (one directory for all of
    them on v2), and the file whose ``oom_kill`` line counts the memory limit's kills
    (``memory.oom_control`` on v1, ``memory.events`` on v2)."""

    dirs: dict[str, str] = field(default_factory=dict)
    oom_file: str = "memory.oom_control"

    def groups(self) -> list[str]:
        """The distinct directories, each once."""
        return list(dict.fromkeys(self.dirs.values()))

    def attach(self, pid: int) -> None:
        """Move `pid` into every group; a group that refuses is dropped (logged)."""
        for path in self.groups():
            try:
                _write(os.path.join(path, "cgroup.procs"), str(pid))
            except OSError as e:
                names = [c for c, d in self.dirs.items() if d == path]
                log.warning("cgroup %s: cannot attach pid %d (%s); running without it",
                            "/".join(names), pid, e.strerror)
                _rmdir_quiet(path)
                for name in names:
                    del self.dirs[name]

    def oom_kills(self) -> int:
        """How many processes of this exec the kernel OOM-killed (memory limit hit)."""
        path = self.dirs.get("memory")
        if path is None:
            return 0
        try:
            with open(os.path.join(path, self.oom_file)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def oom_killed(self) -> bool:
        """True if the kernel OOM-killed a process of this exec (memory limit hit)."""
        return self.oom_kills() > 0

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.groups():
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
        for path in self.groups():
            for _ in range(200):
                if _try_rmdir(path):
                    break
                await asyncio.sleep(0.01)
        self.dirs.clear()


class Cgroups(ABC):
    """Makes per-exec groups under our parent groups (`bases`: controller -> its
    directory, one for all controllers on v2). Use `detect_cgroups()`."""

    def __init__(self, bases: dict[str, str]) -> None:
        self.bases = bases  # controller -> our parent group directory

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.bases))

    def sweep(self) -> None:
        """Remove empty groups whose owner process is dead (a crash skips their removal)."""
        for base in dict.fromkeys(self.bases.values()):
            _sweep(base)

    @abstractmethod
    def create(self, limits: Limits) -> ExecCgroup:
        """A fresh group with the limits set; a controller that fails is dropped."""


class CgroupV1(Cgroups):
    """A group per controller hierarchy, under the caller's own group of each."""

    def create(self, limits: Limits) -> ExecCgroup:
        name = _exec_name()
        group = ExecCgroup()
        for controller, base in self.bases.items():
            path = os.path.join(base, name)
            try:
                _make_group(path)
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


class CgroupV2(Cgroups):
    """One group per exec in the unified hierarchy, holding every controller, under a
    base whose ``cgroup.subtree_control`` enables them (see the module docstring)."""

    def create(self, limits: Limits) -> ExecCgroup:
        group = ExecCgroup(oom_file="memory.events")
        if not self.bases:
            return group
        base = next(iter(self.bases.values()))
        path = os.path.join(base, _exec_name())
        try:
            _make_group(path)
        except OSError as e:
            log.warning("cgroup v2: cannot make %s (%s); running without it", path, e.strerror)
            return group
        for controller in self.bases:
            try:
                if controller == "memory":
                    _write(os.path.join(path, "memory.max"), str(limits.memory_mb * MIB))
                    # No swap either, as v1's memory+swap limit: else the tree could
                    # page out past the limit. Absent without swap accounting.
                    with contextlib.suppress(FileNotFoundError):
                        _write(os.path.join(path, "memory.swap.max"), "0")
                else:
                    _write(os.path.join(path, "pids.max"), str(limits.max_processes))
            except OSError as e:
                log.warning("cgroup v2 %s: cannot set its limit in %s (%s); running without "
                            "it", controller, path, e.strerror)
                continue
            group.dirs[controller] = path
        if not group.dirs:
            _rmdir_quiet(path)
        return group


@functools.cache
def detect_cgroups() -> Cgroups | None:
    """The writable controllers of this process, v1 or v2, or None. Probed once, logged
    once. On v2 this may move the process into a leaf of its own group (see the
    module docstring)."""
    found = probe_cgroups(PROC_CGROUP, MOUNTINFO)
    missing = [c for c in _CONTROLLERS if found is None or c not in found.bases]
    if missing:
        log.info("sandbox cgroup limits unavailable for %s: memory is bounded per process "
                 "by RLIMIT_AS and processes by RLIMIT_NPROC only (not enforced for root)",
                 ", ".join(missing))
    return found


def probe_cgroups(proc_cgroup: str, mountinfo: str) -> Cgroups | None:
    """`detect_cgroups` from these files (this process's /proc/self/cgroup and
    mountinfo): v1 if it offers the memory controller, else v2 if that does, else
    whichever offers more."""
    own = _own_groups(proc_cgroup)
    mounts = _mounts(mountinfo)
    v1 = _v1(own, mounts)
    if v1 is not None and "memory" in v1.bases:
        return v1
    v2 = _v2(own, mounts)
    if v2 is not None and (v1 is None or len(v2.bases) > len(v1.bases)):
        return v2
    return v1


def _v1(own: dict[str, str], mounts: _Mounts) -> CgroupV1 | None:
    bases: dict[str, str] = {}
    for controller in _CONTROLLERS:
        if controller not in own or controller not in mounts.v1:
            continue
        mount_point, mount_root = mounts.v1[controller]
        # /proc/self/cgroup paths are relative to the hierarchy root; the mount may
        # show only a subtree of it (containers), rooted at mount_root.
        rel = os.path.relpath(own[controller], mount_root)
        base = os.path.normpath(os.path.join(mount_point, rel, GROUP_DIR))
        try:
            _make_group(base, exist_ok=True)
            if not os.access(os.path.join(base, "cgroup.procs"), os.W_OK):
                raise PermissionError(errno.EACCES, "cgroup.procs not writable")
        except OSError as e:
            log.info("cgroup v1 %s controller not usable at %s: %s", controller, base, e)
            continue
        bases[controller] = base
    return CgroupV1(bases) if bases else None


def _v2(own: dict[str, str], mounts: _Mounts) -> CgroupV2 | None:
    if "" not in own or mounts.v2 is None:
        return None
    mount_point, mount_root = mounts.v2
    group = os.path.normpath(os.path.join(mount_point, os.path.relpath(own[""], mount_root)))
    try:
        offered = _words(os.path.join(group, "cgroup.controllers"))
        wanted = [c for c in _CONTROLLERS if c in offered]
        if not wanted:
            return None
        parent = os.path.dirname(group)
        if os.path.basename(group) == SERVICE_LEAF and \
                os.path.isdir(os.path.join(parent, GROUP_DIR)):
            group = parent  # the layout a treadle process above us made: share it
        else:
            _enable(group, wanted)
        base = os.path.join(group, GROUP_DIR)
        _make_group(base, exist_ok=True)
        _enable(base, wanted)
        enabled = _words(os.path.join(base, "cgroup.subtree_control"))
    except (OSError, _Occupied) as e:
        log.info("cgroup v2 not usable at %s: %s", group, e)
        return None
    usable = [c for c in wanted if c in enabled]
    return CgroupV2({c: base for c in usable}) if usable else None


class _Occupied(Exception):
    """A v2 group that holds processes other than this one: it cannot pass controllers
    to children, and treadle does not move others' processes."""


def _enable(group: str, controllers: list[str]) -> None:
    """Enable `controllers` for the children of `group`. The kernel refuses (EBUSY)
    while the group holds processes: if this process is the only one, it moves
    itself into the leaf SERVICE_LEAF first; otherwise _Occupied."""
    control = os.path.join(group, "cgroup.subtree_control")
    missing = [c for c in controllers if c not in _words(control)]
    if not missing:
        return
    text = " ".join(f"+{c}" for c in missing)
    try:
        _write(control, text)
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    held = _words(os.path.join(group, "cgroup.procs"))
    if held != [str(os.getpid())]:
        raise _Occupied(f"{group} holds other processes ({len(held)} in all); run treadle "
                        f"alone in a group delegated to it for sandbox cgroup limits")
    leaf = os.path.join(group, SERVICE_LEAF)
    _make_group(leaf, exist_ok=True)
    _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
    log.info("cgroup v2: moved this process into %s to enable %s below %s", leaf, text,
             group)
    _write(control, text)


@dataclass(frozen=True, slots=True)
class _Mounts:
    v1: dict[str, tuple[str, str]]  # controller -> (mount point, mount root)
    v2: tuple[str, str] | None  # the unified hierarchy's (mount point, mount root)


def _own_groups(path: str) -> dict[str, str]:
    """controller -> this process's group path, from /proc/self/cgroup; "" -> its v2
    group (the "0::" line)."""
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                hierarchy, controllers, group = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and not controllers:
                    out[""] = group
                for c in controllers.split(","):
                    if c:
                        out[c] = group
    except (OSError, ValueError):
        pass
    return out


def _mounts(path: str) -> _Mounts:
    """The cgroup mounts of mountinfo: each v1 controller's, and the v2 one (the first)."""
    v1: dict[str, tuple[str, str]] = {}
    v2: tuple[str, str] | None = None
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return _Mounts(v1, v2)
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        where = (_unescape(fields[4]), _unescape(fields[3]))
        if tail[0] == "cgroup2" and v2 is None:
            v2 = where
        elif tail[0] == "cgroup":
            options = tail[2].split(",")
            for controller in _CONTROLLERS:
                if controller in options and controller not in v1:
                    v1[controller] = where
    return _Mounts(v1, v2)


def _words(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def _exec_name() -> str:
    return f"{os.getpid()}-{secrets.token_hex(6)}"


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


def _make_group(path: str, exist_ok: bool = False) -> None:
    """A new group (the kernel fills in its files); its parent must exist."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not exist_ok:
            raise


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _rmdir_quiet(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)

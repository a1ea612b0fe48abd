"""Work dirs on the host: a private work root, bounded work dirs, a cleanup that cannot be misled.

**The work root** holds every sandbox's work dir. It must be private to treadle, or
another local user could plant a directory or a link there and have root create,
chown and delete files through it. `ensure_work_root` refuses a root that is a
symlink, is owned by another user, or is writable by group or others, and one
with an ancestor another user could replace (writable by others and not sticky,
or owned by someone but root and us). The default is `/var/lib/treadle/sandboxes`
for root (no other user can create anything on that path) and
`<tmp>/treadle-sandboxes-<uid>` otherwise (where another user can only make
treadle refuse to start); mode 0711 when sandboxes run as another uid (bwrap,
running as that uid, must traverse it; it cannot list it), else 0700.

**A bounded work dir** is a tmpfs of its own mounted on the work dir (size and
inode count from `Limits`); only root can mount one, so elsewhere the work dir is
a plain directory whose total size is bounded by nothing but the work root's file
system (single files still by RLIMIT_FSIZE). A tmpfs lives in memory (and swap):
its pages are charged to the memory cgroup of whoever wrote them.

**Removal** never follows a link and never recurses: directories are opened with
O_NOFOLLOW relative to their parent's fd, their subdirectories are renamed up into
the work dir itself and emptied in turn (two fds open at any depth), and
permissions are changed only through fds, so a symlink swapped in mid-cleanup
makes the walk delete the link rather than follow it. It never raises: what it
cannot delete is logged and retried by the next sweep (`sweep_stale_workdirs`,
run when a backend starts: dead owners' dirs, and this process's own failures).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from treadle.errors import SandboxStartError, SandboxUnavailable

log = logging.getLogger(__name__)

WORKDIR_PREFIX = "treadle-sb-"  # + "<owner pid>-<random>", so a sweep can find orphans
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_TMPFS_SOURCE = b"treadle-work"  # what mountinfo shows as the source, instead of a host path
_abandoned: set[str] = set()  # this process's work dirs that removal left behind
_mount_refused = False  # mount(2) failed once with EPERM: stop trying (logged once)


@dataclass(frozen=True, slots=True)
class Quota:
    """The bounds of one work dir's tmpfs."""

    size_bytes: int
    inodes: int


def default_work_root() -> str:
    """Where work dirs live unless a backend is told otherwise (see the module docstring)."""
    if os.geteuid() == 0 and _private_ancestor("/var/lib"):
        return "/var/lib/treadle/sandboxes"
    return os.path.join(tempfile.gettempdir(), f"treadle-sandboxes-{os.geteuid()}")


def _private_ancestor(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _safe_ancestor(st)


def _safe_ancestor(st: os.stat_result) -> bool:
    """Nobody but root and us can rename or replace what is inside this directory."""
    if st.st_uid not in (0, os.geteuid()):
        return False
    return not st.st_mode & 0o002 or bool(st.st_mode & stat.S_ISVTX)


def ensure_work_root(root: str, *, traversable: bool) -> None:
    """Create `root` if needed and check that it is private (see the module docstring).

    SandboxUnavailable if it is not: retrying will not help until someone fixes it.
    """
    mode = 0o711 if traversable else 0o700
    try:
        os.makedirs(os.path.dirname(os.path.abspath(root)), mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, mode)
        link = os.path.islink(root)
        real = os.path.realpath(root)
        st = os.lstat(real)
    except OSError as e:
        raise SandboxUnavailable(f"cannot create the sandbox work root {root}: {e}") from e
    problem = None
    if link:
        problem = "it is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"it is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        for parent in _ancestors(real):
            try:
                parent_st = os.lstat(parent)
            except OSError as e:
                problem = f"its parent {parent} cannot be checked ({e.strerror})"
                break
            if not _safe_ancestor(parent_st):
                problem = (f"its parent {parent} could be changed by another user (owner uid "
                           f"{parent_st.st_uid}, mode {stat.S_IMODE(parent_st.st_mode):o})")
                break
    if problem is not None:
        raise SandboxUnavailable(f"refusing the sandbox work root {root}: {problem}; remove it "
                                 "or pass a work_root private to this user")
    if stat.S_IMODE(st.st_mode) & mode != mode:
        try:
            os.chmod(real, stat.S_IMODE(st.st_mode) | mode)
        except OSError as e:
            raise SandboxUnavailable(f"cannot set the mode of the work root {root}: {e}") from e


def _ancestors(path: str) -> list[str]:
    out = []
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out


def create_workdir(root: str, owner: tuple[int, int] | None, quota: Quota | None) -> str:
    """Make one empty work dir under `root`, owned by `owner` (uid, gid) if given.

    With a quota, and where this process may mount, the dir is a tmpfs of that size
    and inode count; elsewhere a plain directory. SandboxStartError if it cannot be
    made; nothing is left behind then.
    """
    try:
        path = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-", dir=root)
    except OSError as e:
        raise SandboxStartError(f"cannot create a sandbox work dir under {root}: {e}") from e
    try:
        if owner is not None:
            os.chown(path, *owner)
        if quota is not None:
            _mount_tmpfs(path, owner, quota)
    except BaseException as e:
        remove_workdir(path)
        if isinstance(e, OSError):
            raise SandboxStartError(f"cannot set up the sandbox work dir {path}: {e}") from e
        raise
    return path


def workdir_bounded(path: str) -> bool:
    """Whether `path` is a mount of its own (the bounded tmpfs) rather than a plain dir."""
    try:
        return os.lstat(path).st_dev != os.lstat(os.path.dirname(path)).st_dev
    except OSError:
        return False


def tmpfs_refused() -> bool:
    """Whether this process was refused mounting a work dir's tmpfs (so work dirs are plain)."""
    return _mount_refused


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: str, owner: tuple[int, int] | None, quota: Quota) -> None:
    global _mount_refused
    if _mount_refused:
        return
    uid, gid = owner if owner is not None else (os.geteuid(), os.getegid())
    data = f"size={quota.size_bytes},nr_inodes={quota.inodes},mode=0700,uid={uid},gid={gid}"
    if _libc().mount(_TMPFS_SOURCE, path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                     data.encode()) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EPERM, errno.EACCES):
        _mount_refused = True
        log.info("cannot mount a tmpfs for sandbox work dirs (%s): their total size and file "
                 "count are not bounded here, only single files are", os.strerror(err))
        return
    raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def remove_workdir(path: str) -> bool:
    """Delete a work dir and everything in it, whatever the sandbox left there.

    Never raises and never follows a link (see the module docstring); False, logged,
    if something is left, which the next sweep retries.
    """
    try:
        _remove(path)
    except Exception as e:  # a cleanup failure must not become the caller's failure
        log.warning("sandbox work dir %s could not be fully removed (%s); the next sweep "
                    "retries", path, e)
        _abandoned.add(path)
        return False
    _abandoned.discard(path)
    return True


def _remove(path: str) -> None:
    parent, name = os.path.split(os.path.abspath(path))
    if workdir_bounded(path) and _libc().umount2(path.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # EINVAL: not a mount point after all; delete its files
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
    parent_fd = os.open(parent, _DIR_FLAGS)
    try:
        chmod = os.geteuid() != 0  # root's CAP_DAC_OVERRIDE ignores the modes left inside
        top = _open_dir(parent_fd, name, chmod)
        if top is None:  # gone, or not a directory: nothing below to walk
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent_fd)
            return
        try:
            _empty(top, chmod)
        finally:
            os.close(top)
        os.rmdir(name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)


def _empty(top: int, chmod: bool) -> None:
    """Delete everything inside the directory open at `top`, iteratively.

    A directory is emptied by unlinking its non-directories and renaming its
    subdirectories into `top`, where they wait their turn; so no depth needs more
    than two fds or one stack frame.
    """
    token = secrets.token_hex(4)
    counter = itertools.count()
    pending: list[str | None] = [None]  # None: top itself; else names directly in top
    while pending:
        name = pending.pop()
        fd = top if name is None else _open_dir(top, name, chmod)
        if fd is None:  # swapped for a non-directory, or gone
            assert name is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=top)
            continue
        try:
            with os.scandir(fd) as entries:
                children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            for child, is_dir in children:
                if not is_dir:
                    try:
                        os.unlink(child, dir_fd=fd)
                        continue
                    except FileNotFoundError:
                        continue
                    except IsADirectoryError:
                        pass  # became a directory since the listing
                if name is None:
                    pending.append(child)
                    continue
                if chmod:
                    _chmod_dir(fd, child)  # moving a directory rewrites its '..'
                moved = f".treadle-rm-{token}-{next(counter)}"
                os.rename(child, moved, src_dir_fd=fd, dst_dir_fd=top)
                pending.append(moved)
        finally:
            if fd != top:
                os.close(fd)
        if name is not None:
            os.rmdir(name, dir_fd=top)


def _open_dir(parent: int, name: str, chmod: bool) -> int | None:
    """An fd of directory `name` under `parent`, never through a link; None if not a dir.

    With `chmod` (no root override of modes), the directory is first given mode
    0700 through an O_PATH fd of that very inode, so that whatever mode the sandbox
    left it in, it can be listed and emptied.
    """
    if chmod and not _chmod_dir(parent, name):
        return None
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise


def _chmod_dir(parent: int, name: str) -> bool:
    """Give directory `name` mode 0700 without following a link; False if not a dir."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except FileNotFoundError:
        return False
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            return False
        # fchmod refuses O_PATH fds; the /proc link reaches exactly the inode of `fd`.
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
        return True
    finally:
        os.close(fd)


def sweep_stale_workdirs(root: str) -> int:
    """Remove work dirs of dead owners (a crash) and this process's failed removals.

    Returns how many were removed; never raises. A dir whose owner pid has been
    reused by a live process is kept, which errs toward leaking rather than
    deleting a live sandbox.
    """
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if not name.startswith(WORKDIR_PREFIX):
            continue
        path = os.path.join(root, name)
        pid_text = name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        mine = int(pid_text) == os.getpid()
        if (mine and path not in _abandoned) or (not mine and pid_alive(int(pid_text))):
            continue
        removed += remove_workdir(path)
    if removed:
        log.info("removed %d stale sandbox work dir(s) under %s", removed, root)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process of that id exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def source_checkout() -> str | None:
    """The source tree treadle is imported from, if it is a checkout (it may hold secrets)."""
    here = Path(__file__).resolve().parent
    for parent in list(here.parents)[:5]:
        if parent != Path("/") and ((parent / ".git").exists() or
                                    (parent / "pyproject.toml").exists()):
            return str(parent)
    return None


def traversable(path: str, uid: int, gid: int) -> bool:
    """Whether uid/gid (no supplementary groups) can reach `path` through its parents."""
    current = Path(path)
    for directory in [*reversed(current.parents), current]:
        try:
            st = os.stat(directory)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            continue
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True

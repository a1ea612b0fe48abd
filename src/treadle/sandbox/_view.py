"""What a bwrap sandbox sees of the host's file system, as bwrap's mount options.

A new root (a tmpfs, read-only after setup) holding the host's system directories
read-only (/usr, /etc, /opt and the /bin, /lib... links; `VISIBLE_TOP_LEVEL`).
Everything else (/home, /root, /tmp, /run with its sockets, /var, /srv, /mnt, /sys,
and any top-level directory nobody thought of) does not exist inside: default
deny. A fresh /proc with /proc/1 (bwrap's pid 1: its /proc/1/mem is otherwise
writable by the same uid), /proc/keys and /proc/key-users covered; a minimal,
read-only /dev with a /dev/shm and a /tmp of the sandbox's own, each `memory_mb` in
size. Then each `expose` path, read-only at its place: mounted after those, so that
one under the host's /tmp (a virtualenv there) shows on top of the sandbox's own
/tmp, with the dirs that lead to it and nothing else of the host's /tmp. Within
what is visible, the caller's working directory, treadle's source checkout, the
password/ssh/sudo files of /etc (`DEFAULT_HIDE`) and any `hide` path are covered
(empty read-only tmpfs, or /dev/null for files). Last, the work dir (with
`bounded_workdirs`, a tmpfs of `workdir_mb` where treadle may mount, see
_workdir.py) bound read-write at the mount point (default /work), the cwd and HOME.

With an image (`FileView.for_image`), the image's top-level entries take the
place of the host's system dirs, read-only (all but /proc, /dev and /tmp, which
are the sandbox's own as above), and the work dir may be mounted at the image's
working dir, at any depth; the rest is the same.

bwrap mounts in the order of its options, and a mount hides what an earlier one put
below its path: hence this order, and the paths `expose` refuses (/tmp as a whole,
/proc, /dev and the mount point, and what is under those three).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from treadle.sandbox import _workdir

log = logging.getLogger(__name__)

# The only top-level host directories a sandbox sees (read-only): programs and
# their libraries and configuration. Everything else - user data, secrets, sockets
# (/run holds docker.sock and dbus), state, /sys, and any directory nobody listed -
# is absent; add what a task needs with `expose`.
VISIBLE_TOP_LEVEL = ("bin", "etc", "lib", "lib32", "lib64", "libx32", "opt", "sbin", "usr")
# Inside the visible tree, secrets that host file modes alone may not protect (they
# do for an unprivileged sandbox uid, not in the root-without-capabilities fallback).
DEFAULT_HIDE = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh",
                "/etc/sudoers", "/etc/sudoers.d", "/etc/security/opasswd")
# Never masked even if the caller's cwd is one of them: the sandbox needs them to run.
_ESSENTIAL = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# What a sandbox may keep in /proc/1 (covered, so that bwrap's pid 1 cannot be
# opened through /proc/1/mem): nothing, read-only.
_PID1_COVER_BYTES = 4096


@dataclass(frozen=True, slots=True)
class FileView:
    """The host paths one backend's sandboxes see; built by `file_view`."""

    mount_point: str  # where the work dir appears: one top-level path (an image's: any)
    expose: tuple[str, ...]  # extra host paths, read-only at their place (normalised)
    hide: tuple[str, ...]  # extra host paths to cover, besides the defaults
    image_root: str | None = None  # an image's root file system: `/` shows it, not the host

    def for_image(self, rootfs: str, working_dir: str | None) -> FileView:
        """This view with `rootfs` as `/` and the work dir at `working_dir` if given.

        The image's top-level entries are bound read-only in place of the host's
        system dirs; nothing of the host shows but `expose`. `working_dir` must be a
        top-level path or a directory the image has (bwrap cannot create a mount
        point inside a read-only bind); ValueError otherwise.
        """
        mount_point = self.mount_point
        if working_dir is not None and working_dir != "/":
            top = "/" + working_dir.strip("/").split("/", 1)[0]
            if top in ("/proc", "/dev", "/tmp"):
                raise ValueError(f"the image's working dir {working_dir} is under {top}, "
                                 "which every sandbox mounts itself")
            if working_dir != top and image_dir(rootfs, working_dir) is None:
                raise ValueError(f"the image's working dir {working_dir} is not a directory "
                                 "of the image (or a link is on its path)")
            mount_point = working_dir
        return FileView(mount_point=mount_point, expose=self.expose, hide=self.hide,
                        image_root=rootfs)

    def masks(self, run_as: tuple[int, int] | None) -> tuple[str, ...]:
        """Visible host paths to cover: the caller's cwd, treadle's checkout, the hides."""
        candidates = [os.getcwd(), *filter(None, [_workdir.source_checkout()]), *DEFAULT_HIDE,
                      *self.hide]
        out: list[str] = []
        for raw in candidates:
            path = os.path.realpath(raw)
            if not os.path.lexists(path) or not self.visible(path):
                continue
            if path == "/" or any(e == path or e.startswith(path.rstrip("/") + "/")
                                  for e in _ESSENTIAL):
                log.warning("not hiding %s from sandboxes: the system needs it", path)
                continue
            if run_as is not None and not _workdir.traversable(path, *run_as):
                continue  # the sandbox uid cannot reach it anyway
            if path not in out:
                out.append(path)
        return tuple(out)

    def visible(self, path: str) -> bool:
        """Whether a (resolved) host path shows inside without a mask."""
        top = "/" + path.strip("/").split("/", 1)[0]
        if top == self.mount_point:
            return False
        if self.image_root is None and top.lstrip("/") in VISIBLE_TOP_LEVEL:
            return True
        return any(path == e or path.startswith(e + "/") for e in self.expose)

    def _root_options(self) -> list[str]:
        """The system dirs: the host's `VISIBLE_TOP_LEVEL`, or every top-level entry of
        the image (but those each sandbox mounts itself, and the work dir's)."""
        opts: list[str] = []
        if self.image_root is None:
            names: list[str] = list(VISIBLE_TOP_LEVEL)
            source = "/"
        else:
            source = self.image_root
            names = sorted(set(os.listdir(source)) - {"proc", "dev", "tmp"})
        for name in names:
            path, host = "/" + name, os.path.join(source, name)
            if path == self.mount_point:
                continue
            if os.path.islink(host):  # merged /usr: /bin -> usr/bin
                opts += ["--symlink", os.readlink(host), path]
            elif os.path.isdir(host) or (self.image_root is not None and os.path.isfile(host)):
                opts += ["--ro-bind", host, path]
        return opts

    def options(self, *, host_dir: str, masks: Sequence[str], scratch_bytes: int,
                sized: bool, mqueue: bool) -> list[str]:
        """The mount options of one launch, in the order of the module docstring.

        host_dir: the work dir; masks: `masks()`'s paths; scratch_bytes: the size of
        /tmp and /dev/shm, given where `sized` (this bwrap has --size); mqueue: mount
        the IPC namespace's POSIX message queues at /dev/mqueue (the resident agent
        empties them).
        """
        opts = self._root_options()

        def size(n: int) -> list[str]:
            return ["--size", str(n)] if sized else []

        # /proc/1 is bwrap's pid 1 (no RLIMIT_NPROC; the death signal that ends the
        # namespace): its /proc/1/mem must not be writable by the command, which runs as
        # the same uid. Keys: /proc/keys lists every key the sandbox uid may view.
        opts += ["--proc", "/proc", "--perms", "0555", *size(_PID1_COVER_BYTES),
                 "--tmpfs", "/proc/1", "--remount-ro", "/proc/1",
                 "--ro-bind", "/dev/null", "/proc/keys", "--ro-bind", "/dev/null",
                 "/proc/key-users"]
        # bwrap's /dev is a tmpfs of half the RAM, writable by the sandbox uid, with
        # /dev/shm a plain directory in it: give /dev/shm a tmpfs sized like /tmp and
        # make the rest read-only (its device nodes are mounts of their own, still usable).
        opts += ["--dev", "/dev", "--perms", "1777", *size(scratch_bytes), "--tmpfs", "/dev/shm",
                 *(["--mqueue", "/dev/mqueue"] if mqueue else []),
                 "--remount-ro", "/dev", "--perms", "1777", *size(scratch_bytes),
                 "--tmpfs", "/tmp"]
        for path in self.expose:
            opts += ["--ro-bind", path, path]
        for path in masks:
            if os.path.isdir(path):
                opts += ["--tmpfs", path, "--remount-ro", path]
            else:
                opts += ["--ro-bind", "/dev/null", path]
        return [*opts, "--bind", host_dir, self.mount_point, "--remount-ro", "/",
                "--chdir", self.mount_point]


def image_dir(rootfs: str, path: str) -> str | None:
    """The host path of directory `path` of an image, if every part of it is a real
    directory; None if it is absent or a symlink is on the way (the host must never
    follow an image's link: `/a -> /root` would lead out of the image)."""
    current = rootfs
    for part in path.strip("/").split("/"):
        if part in ("", ".", ".."):
            return None
        current = os.path.join(current, part)
        try:
            if not stat.S_ISDIR(os.lstat(current).st_mode):
                return None
        except OSError:
            return None
    return current


def file_view(mount_point: str, expose: Sequence[str], hide: Sequence[str]) -> FileView:
    """A checked `FileView`; ValueError for a mount point or an `expose` path it
    cannot honour (see the module docstring)."""
    if not mount_point.startswith("/") or mount_point.count("/") != 1 or mount_point == "/":
        raise ValueError(f"mount_point must be one top-level path like '/work', got "
                         f"{mount_point!r}")
    for path in expose:
        if not os.path.isabs(path) or os.path.normpath(path) == "/":
            raise ValueError(f"expose paths must be absolute and not '/', got {path!r}")
    exposed = tuple(os.path.normpath(p) for p in expose)
    for path in exposed:
        if path == "/tmp":
            raise ValueError("expose cannot show the host's whole /tmp (the sandbox's /tmp "
                             "is its own scratch); expose the paths under it that a task "
                             "needs")
        for own in ("/proc", "/dev", mount_point):
            if path == own or path.startswith(own + "/"):
                raise ValueError(f"expose cannot show {path!r}: every sandbox mounts its "
                                 f"own {own} there")
    return FileView(mount_point=mount_point, expose=exposed, hide=tuple(hide))

"""The image cache: images unpacked once per host, by digest, shared read-only, evicted by size.

Layout of the cache root (default: `$TREADLE_CACHE/images`, else
`/var/cache/treadle/images` for root and `~/.cache/treadle/images` otherwise):

    .lock                      flock: one unpack or eviction at a time (all processes)
    <algorithm>-<hex>/         one image, named by its digest (`Source.digest`)
        rootfs/                the unpacked root file system
        image.json             digest, config (Env, WorkingDir, User), size, unpack time
        used                   touched on every open: its mtime orders eviction (LRU)
    .staging-<random>/         an unpack in progress (removed by the next unpack if dead)

An entry appears by rename once complete, so a reader never sees half an image.
SIF images are extracted by `unsquashfs` (Debian's `squashfs-tools`) from their
squashfs partition at its offset (`_sif`). Layers are applied by `umoci unpack
--rootless` (Debian's `umoci`): it handles
whiteouts and opaque directories, refuses paths that leave the root, and, rootless,
creates no device nodes and changes no ownership (every file belongs to the user
that unpacked it). treadle writes no tar extraction of its own.

An opened image is *in use* until its `CachedImage` is released (or collected):
the open holds a shared flock on the entry's `used` file, and eviction takes only
entries whose lock it can take exclusively. Eviction runs after each unpack and
removes least recently used entries until the cache holds at most `max_bytes`
(the image just opened is never removed, so one image larger than the bound stays).

The root must be private to this user (the checks of the sandbox work root: not a
link, owned by us, not writable by others, no ancestor another user can change);
its contents become sandboxes' root file systems.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

from treadle.errors import SandboxImageError, SandboxUnavailable
from treadle.sandbox import _workdir
from treadle.sandbox.images._layout import (
    REF_NAME,
    ImageConfig,
    Source,
    identify,
    read_config,
    stage_layout,
)
from treadle.sandbox.images._sif import read_sif_file

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 20 << 30
_DEFAULT_CACHES: dict[str, ImageCache] = {}
_UNSQUASHFS_HINT = ("reading SIF images needs unsquashfs: `bash scripts/system-deps.sh "
                    "squashfs-tools` (or apt-get install squashfs-tools)")
_UMOCI_HINT = ("reading OCI and docker images needs umoci: `bash scripts/system-deps.sh "
               "umoci` (or apt-get install umoci)")
_UMOCI_TIMEOUT_S = 1800.0


def default_cache_root() -> str:
    """Where images are unpacked unless told otherwise (see the module docstring)."""
    base = os.environ.get("TREADLE_CACHE")
    if base:
        return os.path.join(base, "images")
    if os.geteuid() == 0:
        # Not under /root (mode 0700): the sandbox uid must traverse to the rootfs.
        return "/var/cache/treadle/images"
    return os.path.join(os.path.expanduser("~"), ".cache", "treadle", "images")


def default_cache() -> ImageCache:
    """One `ImageCache` per process at `default_cache_root()` (backends share its memo)."""
    root = default_cache_root()
    cache = _DEFAULT_CACHES.get(root)
    if cache is None:
        cache = _DEFAULT_CACHES[root] = ImageCache(root)
    return cache


@dataclass(slots=True, weakref_slot=True)
class CachedImage:
    """An image ready to run: its root file system and config.

    Hold it while sandboxes of the image live; `release()` (or garbage collection)
    lets eviction take it. A rootfs-directory image is not cached (`digest` None).
    """

    ref: str
    kind: str  # see _layout.Source
    digest: str | None
    rootfs: str  # absolute path of the root file system on the host
    config: ImageConfig
    unpacked_s: float | None = None  # seconds this open spent unpacking; None: it was cached
    _lease: int | None = field(default=None, repr=False)
    _finalizer: weakref.finalize[[int], CachedImage] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Let eviction remove this image (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class ImageCache:
    """Unpacks images into `root` (see the module docstring); safe across processes."""

    def __init__(self, root: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.root = os.path.abspath(root or default_cache_root())
        self.max_bytes = max_bytes
        # An archive's digest means reading its index (a gzipped one: all of it); an
        # unchanged file (same inode, size and mtime) is not read again.
        self._identified: dict[tuple[str, int, int, int, int], Source] = {}

    def open(self, ref: str) -> CachedImage:
        """The image `ref` names, unpacked here first if not yet cached (blocking).

        SandboxImageError for a missing, corrupt or unreadable image, or one umoci
        refuses; SandboxUnavailable for a cache root that is not private.
        """
        source = self._identify(ref)
        if source.kind == "rootfs":
            return CachedImage(ref=ref, kind="rootfs", digest=None, rootfs=source.ref,
                               config=ImageConfig())
        assert source.digest is not None
        self._ensure_root()
        entry = os.path.join(self.root, source.digest.replace(":", "-"))
        image = self._lease(source, entry, None)
        if image is None:
            with self._locked():  # one unpack at a time; another process may beat us to it
                unpacked_s = None if os.path.isdir(entry) else self._unpack(source, entry)
                image = self._lease(source, entry, unpacked_s)
                if image is None:
                    raise SandboxImageError(f"image {ref}: its cache entry {entry} vanished "
                                            "while the cache was locked")
                if unpacked_s is not None:
                    self._evict(keep=entry)
        return image

    def entries(self) -> list[tuple[str, int, float]]:
        """Cached images as (entry dir, bytes, last use as a Unix time), oldest use first."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.root):
                path = os.path.join(self.root, name)
                if name.startswith(".") or not os.path.isdir(path):
                    continue
                try:
                    with open(os.path.join(path, "image.json"), "rb") as f:
                        size = int(json.load(f)["bytes"])
                    used = os.stat(os.path.join(path, "used")).st_mtime
                except (OSError, ValueError, KeyError):
                    continue  # half-removed; the next eviction retries
                out.append((path, size, used))
        return sorted(out, key=lambda e: e[2])

    def evict(self) -> int:
        """Remove least recently used images not in use until at most `max_bytes` remain
        (`open` does after each unpack). Returns how many were removed."""
        self._ensure_root()
        with self._locked():
            return self._evict(keep=None)

    # -- internals -------------------------------------------------------------

    def _evict(self, *, keep: str | None) -> int:
        """`evict`, with the cache lock held, never removing `keep`."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = 0
        for path, size, _ in entries:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            lock = self._take_unused(path)
            if lock is None:
                continue
            try:  # held until deleted: an open waiting on it then sees the entry gone
                trash = os.path.join(self.root,
                                     f".staging-evict-{os.getpid()}-{time.monotonic_ns()}")
                os.rename(path, trash)  # gone from the cache at once; deleted below
                _workdir.remove_workdir(trash)
            finally:
                os.close(lock)
            total -= size
            removed += 1
            log.info("evicted image %s (%d MiB) from %s", os.path.basename(path), size >> 20,
                     self.root)
        return removed

    def _identify(self, ref: str) -> Source:
        try:
            st = os.stat(ref)
        except OSError:
            return identify(ref)  # raises the image error
        if not os.path.isfile(ref):
            return identify(ref)  # a directory: its index.json is small
        key = (os.path.abspath(ref), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        source = self._identified.get(key)
        if source is None:
            source = self._identified[key] = identify(ref)
        return source

    def _ensure_root(self) -> None:
        try:
            _workdir.ensure_work_root(self.root, traversable=True)
        except SandboxUnavailable as e:
            raise SandboxUnavailable(f"image cache: {e}") from e

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(os.path.join(self.root, ".lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _take_unused(self, entry: str) -> int | None:
        """An fd holding `entry`'s lock exclusively, or None while it is in use."""
        try:
            fd = os.open(os.path.join(entry, "used"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _lease(self, source: Source, entry: str, unpacked_s: float | None) -> CachedImage | None:
        """The entry, held in use; None if it is absent (or was evicted while we waited)."""
        used = os.path.join(entry, "used")
        try:
            fd = os.open(used, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SandboxImageError(f"image {source.ref}: cannot open its cache entry {entry} "
                                    f"({e})") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out an eviction of this very entry
            held = os.fstat(fd)
            try:
                current = os.lstat(used)
            except FileNotFoundError:
                os.close(fd)  # evicted meanwhile
                return None
            if (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
                os.close(fd)
                return None
            with open(os.path.join(entry, "image.json"), "rb") as f:
                meta = json.load(f)
            os.utime(fd)
        except (OSError, ValueError) as e:
            os.close(fd)
            raise SandboxImageError(f"image {source.ref}: its cache entry {entry} is damaged "
                                    f"({e}); remove it to unpack again") from e
        config = meta.get("config") or {}
        image = CachedImage(
            ref=source.ref, kind=source.kind, digest=source.digest,
            rootfs=os.path.join(entry, "rootfs"), unpacked_s=unpacked_s, _lease=fd,
            config=ImageConfig(env=tuple((k, v) for k, v in config.get("env") or []),
                               working_dir=config.get("working_dir"), user=config.get("user")))
        image._finalizer = weakref.finalize(image, _close, fd)
        return image

    def _unpack(self, source: Source, entry: str) -> float:
        tool = "unsquashfs" if source.kind == "sif" else "umoci"
        path = shutil.which(tool)
        if path is None:
            raise SandboxImageError(f"image {source.ref}: "
                                    + (_UNSQUASHFS_HINT if tool == "unsquashfs" else _UMOCI_HINT))
        self._sweep_staging()
        started = time.monotonic()
        staging = tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-", dir=self.root)
        try:
            final = os.path.join(staging, "entry")
            os.mkdir(final, 0o755)
            rootfs = os.path.join(final, "rootfs")
            if source.kind == "sif":
                digest, config = source.digest, ImageConfig()
                _unsquash(path, source, rootfs)
            else:
                digest, config = _umoci_unpack(path, source, staging, rootfs)
            os.chmod(rootfs, 0o755)
            size = _disk_usage(os.path.join(final, "rootfs"))
            meta = {"ref": source.ref, "kind": source.kind, "digest": source.digest,
                    "manifest": digest, "bytes": size,
                    "unpack_s": round(time.monotonic() - started, 3),
                    "config": {"env": [list(kv) for kv in config.env],
                               "working_dir": config.working_dir, "user": config.user}}
            with open(os.path.join(final, "image.json"), "w") as f:
                json.dump(meta, f, indent=1)
            with open(os.path.join(final, "used"), "w"):
                pass
            os.rename(final, entry)
        except OSError as e:
            raise SandboxImageError(f"image {source.ref}: cannot unpack into {self.root}: "
                                    f"{e}") from e
        except subprocess.TimeoutExpired as e:
            raise SandboxImageError(f"image {source.ref}: {tool} took over "
                                    f"{_UMOCI_TIMEOUT_S:.0f} s") from e
        finally:
            _workdir.remove_workdir(staging)
        log.info("unpacked image %s (%s) in %.1f s", source.ref, source.digest,
                 time.monotonic() - started)
        return time.monotonic() - started

    def _sweep_staging(self) -> None:
        """Staging dirs of dead processes (a crash mid-unpack); under the cache lock."""
        for name in os.listdir(self.root):
            if name.startswith(".staging-"):
                pid = name.split("-")[-2] if name.startswith(".staging-evict-") else \
                    name[len(".staging-"):].split("-", 1)[0]
                if pid.isdigit() and int(pid) != os.getpid() and \
                        not _workdir.pid_alive(int(pid)):
                    _workdir.remove_workdir(os.path.join(self.root, name))


def _umoci_unpack(umoci: str, source: Source, staging: str,
                  rootfs: str) -> tuple[str | None, ImageConfig]:
    """An OCI or docker image's layers applied at `rootfs`: (manifest digest, config)."""
    layout = os.path.join(staging, "layout")
    os.mkdir(layout)
    stage_layout(source, layout)
    digest, config = read_config(layout, source.ref)
    # `raw unpack`: the root file system only. (`unpack` also writes a runtime
    # config, and fails on a User missing from the image's /etc/passwd.)
    proc = subprocess.run([umoci, "raw", "unpack", "--rootless", "--image",
                           f"{layout}:{REF_NAME}", rootfs], capture_output=True, text=True,
                          timeout=_UMOCI_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise SandboxImageError(f"image {source.ref}: umoci cannot unpack it: "
                                + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return digest, config


def _unsquash(unsquashfs: str, source: Source, rootfs: str) -> None:
    """A SIF image's system partition extracted at `rootfs` (`_sif`): `unsquashfs`
    reads the squashfs at its offset in the file, no mount, from the file opened
    here and checked against the digest it was identified by (a file replaced since
    is refused, not unpacked into the old one's entry). Extended attributes are not
    restored; a device node a user other than root may not make is left out, as
    umoci's rootless unpack leaves it (unsquashfs's exit status 2 with nothing but
    those); any other error fails the unpack (a damaged block is one); then
    `_as_rootless`."""
    ref = source.ref
    with open(ref, "rb") as f:
        part = read_sif_file(f, ref)
        if part.digest != source.digest:
            raise SandboxImageError(f"image {ref}: it changed since it was identified; "
                                    "open it again")
        proc = subprocess.run([unsquashfs, "-quiet", "-no-progress", "-no-xattrs", "-offset",
                               str(part.offset), "-dest", rootfs, f"/proc/self/fd/{f.fileno()}"],
                              capture_output=True, text=True, timeout=_UMOCI_TIMEOUT_S,
                              check=False, pass_fds=(f.fileno(),))
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    devices_only = proc.returncode == 2 and os.getuid() != 0 and all(
        "because you're not superuser" in line for line in errors)
    if (proc.returncode != 0 and not devices_only) or not os.path.isdir(rootfs):
        raise SandboxImageError(f"image {ref}: unsquashfs cannot read its system partition: "
                                + (errors or ["?"])[-1])
    _as_rootless(rootfs)


def _as_rootless(rootfs: str) -> None:
    """Make an extracted tree what umoci's rootless unpack makes: every file ours,
    no device node, FIFO or socket (each becomes an empty file), no setuid or setgid
    bit (a device unsquashfs could not make, run as another user than root, is
    absent). Run as root, unsquashfs restores the image's owners and makes its devices:
    an image could otherwise leave, in the shared cache, a device node or a file
    another host user owns (the staging directory is 0700 until then)."""
    uid, gid = os.getuid(), os.getgid()
    def unreadable(e: OSError) -> None:
        raise e  # a directory walked past would keep what is in it

    for directory, dirs, files in os.walk(rootfs, onerror=unreadable):
        for name in (*dirs, *files):
            path = os.path.join(directory, name)
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or \
                    stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                os.unlink(path)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                 0o644))
                continue
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.lchown(path, uid, gid)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))


def _disk_usage(path: str) -> int:
    """Bytes a tree takes on disk (allocated blocks; hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for directory, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(directory, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total

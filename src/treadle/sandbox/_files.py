"""Host-side file I/O in a work dir, never through a link the sandbox planted.

A work dir belongs to the sandbox, and commands inside may have planted symlinks,
FIFOs or directories where a file is expected. Host code (which may run as root)
therefore never follows a symlink inside a work dir: every path is walked one
component at a time with O_NOFOLLOW relative to the previous directory's fd, so a
link to /etc/shadow (or a component swapped for one mid-walk) is refused instead of
followed. Writes go to a fresh temporary name and are renamed into place, so they
never write through an existing file or FIFO. `..` is refused outright rather
than resolved.

Limits: symlinks inside the work dir are not followed even when they point inside
it; hard links are not detected (a command can only hard-link files on the same
mount, i.e. files already inside its work dir). Creating, bounding and removing
work dirs is `_workdir`'s.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from treadle.errors import (
    SandboxFileError,
    SandboxFileTooLarge,
    SandboxPathError,
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_path(path: str, workdir: str) -> list[str]:
    """The components of `path` below the work dir; SandboxPathError if it leaves it.

    Accepts a relative path or an absolute one under `workdir` (the inside view).
    """
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxPathError(f"invalid sandbox path {path!r}")
    if path.startswith("/"):
        base = workdir.rstrip("/") + "/"
        if not path.startswith(base):
            raise SandboxPathError(f"{path!r} is outside the work dir {workdir}")
        path = path[len(base):]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise SandboxPathError(f"{path!r}: '..' is not allowed in sandbox paths")
    if not parts:
        raise SandboxPathError(f"{path!r} names the work dir itself, not a file")
    return parts


def _open_parent(workdir: str, parts: list[str], *, create: bool,
                 owner: tuple[int, int] | None) -> int:
    """An fd of the directory holding parts[-1], walked without following symlinks."""
    fd = os.open(workdir, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                next_fd = _open_child_dir(fd, name, create=create, owner=owner)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SandboxPathError(
                        f"{'/'.join(parts)!r}: component {name!r} is a symlink or not a directory"
                    ) from None
                if e.errno == errno.ENOENT:
                    raise SandboxFileError(f"no such directory {name!r} in the work dir") from None
                raise
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child_dir(fd: int, name: str, *, create: bool, owner: tuple[int, int] | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):  # a concurrent put made it first
        os.mkdir(name, 0o755, dir_fd=fd)
    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    if owner is not None:
        os.fchown(child, *owner)
    return child


def write_file(workdir: str, parts: list[str], data: bytes, owner: tuple[int, int] | None) -> None:
    """Atomically replace parts (under workdir) with `data`, mode 0644.

    SandboxFileError if it cannot be written (a full work dir, a file size limit).
    """
    try:
        parent = _open_parent(workdir, parts, create=True, owner=owner)
    except OSError as e:
        raise SandboxFileError(f"cannot write {'/'.join(parts)!r}: {e.strerror}") from None
    tmp = f".treadle-put-{secrets.token_hex(8)}"
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=parent)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if owner is not None:
                    os.fchown(fd, *owner)
            finally:
                os.close(fd)
            os.replace(tmp, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise SandboxFileError(f"cannot write {'/'.join(parts)!r}: {e.strerror}") from None
    finally:
        os.close(parent)


def read_file(workdir: str, parts: list[str], max_bytes: int) -> bytes:
    """Read a regular file under workdir; refuses symlinks, FIFOs, devices and dirs."""
    if max_bytes < 0:
        raise ValueError("max_bytes must be >= 0")
    where = "/".join(parts)
    parent = _open_parent(workdir, parts, create=False, owner=None)
    try:
        try:
            # O_NONBLOCK: opening a FIFO planted by the sandbox must not hang us.
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=parent)
        except FileNotFoundError:
            raise SandboxFileError(f"no such file {where!r} in the work dir") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SandboxPathError(f"{where!r} is a symlink; not followed") from None
            raise SandboxFileError(f"cannot open {where!r}: {e.strerror}") from None
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SandboxFileError(f"{where!r} is not a regular file")
        if st.st_size > max_bytes:
            raise SandboxFileTooLarge(f"{where!r} has {st.st_size} bytes, more than {max_bytes}")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # grew after the fstat
            raise SandboxFileTooLarge(f"{where!r} has more than {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)

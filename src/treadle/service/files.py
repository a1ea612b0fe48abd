"""Files a job may name: only under the service's data roots, only regular files of a
bounded size, opened so that nothing can be swapped in between check and read.

A suite option that names a host file (`Suite.file_options`, e.g. nemo_gym's
``rows_path``, search's ``corpus``) is opened by the service, so without a fence a
job could make it read any path (``/dev/zero`` drove a service to 2 GB in two
seconds) and learn which paths exist from the answers. `held_file` refuses a path
that is not absolute or does not lie under a root, with the same answer whether or
not it exists; inside, it opens it one component at a time from the root with
``O_NOFOLLOW`` (no symlink is followed, so none planted or swapped in takes the
read elsewhere), checks the open file (regular, at most `max_bytes`) and yields a
`HeldFile`: the path the suite reads (``/proc/self/fd/N``: that very file, however
the name changes meanwhile) and its identity (device, inode, size, mtime), by which
a suite built from it is cached. The file stays open for the block.

Limits: the size is checked when it is opened; a file that grows afterwards is read
up to the reader's own bound (`envs.records.read_jsonl`: 1 GiB). Linux (/proc).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from treadle.service.errors import RequestRefused


@dataclass(frozen=True, slots=True)
class HeldFile:
    """A file opened for a suite; valid while its `held_file` block runs."""

    path: str  # what the suite opens: /proc/self/fd/N
    identity: tuple[int, int, int, int]  # (device, inode, size, mtime ns): the content


@contextlib.contextmanager
def held_file(value: object, roots: Sequence[str], max_bytes: int,
              field: str) -> Iterator[HeldFile]:
    """Open the file `value` names under one of `roots`; RequestRefused naming `field`."""
    if not roots:
        raise RequestRefused(f"{field}: this service opens no file a job names (start it "
                             "with --data-root DIR to allow files under DIR)")
    if not isinstance(value, str) or not value or "\0" in value or not os.path.isabs(value):
        raise RequestRefused(f"{field}: must be an absolute path under the service's data "
                             "roots")
    # Lexically (no symlink resolved): `..` cannot climb out, and a link is refused
    # below when the walk meets it.
    path = os.path.normpath(value)
    root = next((r for r in map(os.path.normpath, roots) if _inside(path, r)), None)
    if root is None:
        raise RequestRefused(f"{field}: not under the service's data roots")
    try:
        fd = _open_beneath(root, os.path.relpath(path, root))
    except OSError as e:
        why = ("a symbolic link" if e.errno in (errno.ELOOP, errno.ENOTDIR)
               else e.strerror or str(e))
        raise RequestRefused(f"{field}: cannot read it ({why})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RequestRefused(f"{field}: not a regular file")
        if st.st_size > max_bytes:
            raise RequestRefused(f"{field}: {st.st_size} bytes, over the {max_bytes} a job's "
                                 "file may have")
        yield HeldFile(f"/proc/self/fd/{fd}", (st.st_dev, st.st_ino, st.st_size,
                                              st.st_mtime_ns))
    finally:
        os.close(fd)


def _open_beneath(root: str, relative: str) -> int:
    """An fd of `root/relative`, each component opened with O_NOFOLLOW from the one
    before (a FIFO or device is opened without blocking; the caller checks what it
    is)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parts = [p for p in relative.split(os.sep) if p not in ("", ".")]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (
                os.O_NONBLOCK if last else os.O_DIRECTORY)
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_under_roots(value: str, roots: Sequence[str], field: str) -> None:
    """RequestRefused unless `value`, its links resolved, lies under one of `roots` (for a
    path the service does not open itself, e.g. an image a sandbox runs on). Resolved
    now: a link swapped in later is not seen (the roots are the operator's)."""
    if not roots:
        raise RequestRefused(f"{field}: this service lets no job name host paths (start it "
                             "with --data-root DIR to allow paths under DIR)")
    real = os.path.realpath(value)
    if not any(_inside(real, os.path.realpath(root)) for root in roots):
        raise RequestRefused(f"{field}: {value!r} is not under the service's data roots")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


__all__ = ["HeldFile", "check_under_roots", "held_file"]

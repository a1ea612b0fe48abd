"""Files a job may name: only under the service's data roots, only regular files of a
bounded size.

A suite option that names a host file (`Suite.file_options`, e.g. nemo_gym's
``rows_path``) is opened by the service, so without a fence a job could make it
read any path (``/dev/zero`` drove a service to 2 GB in two seconds) and learn
which paths exist from the answers. The check resolves the path (symlinks
included) and refuses anything outside every root with the same answer whether or
not it exists; inside, it must be a regular file of at most `max_bytes`. The suite
is then given the resolved path.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from treadle.service.errors import RequestRefused


def allowed_file(value: object, roots: Sequence[str], max_bytes: int, field: str) -> str:
    """The resolved path `value` names, or RequestRefused naming `field`."""
    if not roots:
        raise RequestRefused(f"{field}: this service opens no file a job names (start it "
                             "with --data-root DIR to allow files under DIR)")
    if not isinstance(value, str) or not value or "\0" in value or not os.path.isabs(value):
        raise RequestRefused(f"{field}: must be an absolute path under the service's data "
                             "roots")
    path = os.path.realpath(value)
    if not any(_inside(path, os.path.realpath(root)) for root in roots):
        raise RequestRefused(f"{field}: not under the service's data roots")
    try:
        st = os.stat(path)
    except OSError as e:
        raise RequestRefused(f"{field}: cannot read it ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RequestRefused(f"{field}: not a regular file")
    if st.st_size > max_bytes:
        raise RequestRefused(f"{field}: {st.st_size} bytes, over the {max_bytes} a job's "
                             "file may have")
    return path


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


__all__ = ["allowed_file"]

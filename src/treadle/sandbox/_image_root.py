"""What a bwrap sandbox on an image needs from the image: programs, environment, work tree.

- Programs: bwrap runs `prlimit` inside the sandbox (RLIMIT_NPROC must be set once
  the user namespace exists), and the resident executor runs its agent with
  `python3`; on an image both are the image's own (the host's would need the
  host's libraries). An image without `prlimit` (util-linux) is refused; one
  without python3 under /usr/bin or /bin runs every exec in its own bwrap launch.
- Environment: the image's `Env` over treadle's base (PATH, LANG, TMPDIR), then
  HOME = the work dir, then the exec's own `env`.
- Work tree: when the image's config names a `WorkingDir` (other than `/`), the
  sandbox's private work dir is mounted there and starts as a copy of what the
  image holds at that path (`cp -a --reflink=auto` as the sandbox's uid, sharing
  blocks where the file system can; what that uid cannot read is not copied), so
  that the agent may edit the image's project while the image itself stays
  read-only and unchanged for every other sandbox. The copy costs a process and
  the tree's size per sandbox start (an overlay would not; bwrap 0.8 has none).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess

from treadle.errors import SandboxImageError, SandboxStartError
from treadle.sandbox import _workdir
from treadle.sandbox._view import image_dir
from treadle.sandbox.images import CachedImage

_PRLIMIT = ("/usr/bin/prlimit", "/bin/prlimit", "/usr/sbin/prlimit", "/sbin/prlimit")
_PYTHON = ("/usr/bin/python3", "/bin/python3")
_SEED_TIMEOUT_S = 600.0


def _has(rootfs: str, path: str) -> bool:
    """Whether `path` exists in the image (a link is trusted to resolve inside it)."""
    return os.path.lexists(os.path.join(rootfs, path.lstrip("/")))


def image_prlimit(image: CachedImage) -> str:
    """The image's prlimit, as a path inside the sandbox; SandboxImageError if it has none
    (or no /bin/sh, which the backend's start-up check runs)."""
    if not _has(image.rootfs, "/bin/sh"):
        raise SandboxImageError(f"image {image.ref}: no /bin/sh; bwrap sandboxes check that "
                                "one starts before serving execs")
    for path in _PRLIMIT:
        if _has(image.rootfs, path):
            return path
    raise SandboxImageError(f"image {image.ref}: no prlimit (util-linux) under /usr/bin, /bin "
                            "or the sbin dirs; bwrap sandboxes need it to limit processes")


def image_python(image: CachedImage) -> str | None:
    """The image's python3 for the resident executor, or None (per-call execs)."""
    return next((path for path in _PYTHON if _has(image.rootfs, path)), None)


def image_env(image: CachedImage | None, base: dict[str, str], home: str) -> dict[str, str]:
    """An exec's starting environment: `base`, the image's Env over it, HOME = `home`."""
    env = dict(base)
    if image is not None:
        env.update(image.config.env)
    env["HOME"] = home
    return env


def seed_workdir(image: CachedImage, working_dir: str, host_dir: str,
                 owner: tuple[int, int] | None) -> None:
    """Copy the image's `working_dir` into the (empty) work dir `host_dir`, owned by
    `owner` if given. Nothing to copy if the image lacks it. SandboxStartError if
    the copy fails (the caller removes the work dir)."""
    source = image_dir(image.rootfs, working_dir)
    if source is None:  # absent (the work dir starts empty), or behind a link: never followed
        return
    # As the sandbox's uid (when treadle is root): the copy is then its own, and holds
    # only what that uid could read in the image anyway (one process, no chown pass).
    who: dict[str, object] = {} if owner is None else \
        {"user": owner[0], "group": owner[1], "extra_groups": []}
    try:
        proc = subprocess.run(["cp", "-a", "--reflink=auto", "--no-target-directory", source,
                               host_dir], capture_output=True, text=True, check=False,
                              timeout=_SEED_TIMEOUT_S, env={"PATH": "/usr/bin:/bin"},
                              **who)  # type: ignore[call-overload]
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxStartError(f"cannot copy {working_dir} of image {image.ref} into the "
                                f"work dir: {e}") from e
    if proc.returncode != 0:
        raise SandboxStartError(f"cannot copy {working_dir} of image {image.ref} into the "
                                f"work dir: {proc.stderr.strip()[-300:]}")
    os.chmod(host_dir, 0o700)  # cp -a gave it the image dir's mode


async def seeded_workdir(work_root: str, owner: tuple[int, int] | None,
                         quota: _workdir.Quota | None, image: CachedImage) -> str:
    """A new work dir holding a copy of the image's working dir (in a thread: a big tree
    takes a while); a cancelled start waits for the copy, then removes the dir."""
    assert image.config.working_dir is not None
    working_dir = image.config.working_dir

    def create() -> str:
        host_dir = _workdir.create_workdir(work_root, owner, quota)
        try:
            seed_workdir(image, working_dir, host_dir, owner)
        except BaseException:
            _workdir.remove_workdir(host_dir)
            raise
        return host_dir

    task = asyncio.ensure_future(asyncio.to_thread(create))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            host_dir = await asyncio.shield(task)
            await asyncio.to_thread(_workdir.remove_workdir, host_dir)
        raise

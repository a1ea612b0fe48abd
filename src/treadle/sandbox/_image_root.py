"""What a bwrap sandbox on an image needs from the image: programs, environment, work tree.

- Programs: bwrap runs `prlimit` inside the sandbox (RLIMIT_NPROC must be set once
  the user namespace exists), and the resident executor runs its agent with
  `python3`; on an image both are the image's own (the host's would need the
  host's libraries). An image without `prlimit` (util-linux) is refused; one
  without python3 under /usr/bin or /bin runs every exec in its own bwrap launch.
- Environment: the image's `Env` over treadle's base (PATH, LANG, TMPDIR), then
  HOME = the work dir, then the exec's own `env`.
- User: the image's `User` (a name or uid, with an optional group or gid) is the
  uid and gid commands see inside the sandbox's user namespace (`image_ids`; names
  through the image's /etc/passwd and /etc/group, as Docker reads them). On the
  host they stay the sandbox uid: the mapping names the one id the namespace has,
  it grants nothing. A `User` of root (uid 0) is not applied: uid 0 inside would
  hold every capability of the namespace, so commands keep the sandbox uid.
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
_MAX_ID = 2**32 - 1  # (uid_t)-1 is "no id"
_MAX_TABLE_BYTES = 4 * 1024 * 1024


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


def image_ids(image: CachedImage) -> tuple[int, int] | None:
    """The (uid, gid) the image's `User` names inside the sandbox; None without a
    `User` or for root (module docstring). A uid without a group takes its passwd
    entry's group, else 0. SandboxImageError for a name the image does not know, a
    malformed `User`, or a passwd or group file that leads out of the image."""
    user = image.config.user
    if not user:
        return None
    name, _, group = user.partition(":")
    users = _table(image, "/etc/passwd")
    if name.isdigit():
        uid = int(name)
        default_gid = next((g for u, g in users.values() if u == uid), 0)
    elif name in users:
        uid, default_gid = users[name]
    else:
        raise SandboxImageError(f"image {image.ref}: its User {user!r} names no user of its "
                                "/etc/passwd")
    if not group:
        gid = default_gid
    elif group.isdigit():
        gid = int(group)
    else:
        groups = _table(image, "/etc/group")
        if group not in groups:
            raise SandboxImageError(f"image {image.ref}: its User {user!r} names no group "
                                    "of its /etc/group")
        gid = groups[group][0]
    if uid >= _MAX_ID or gid >= _MAX_ID:
        raise SandboxImageError(f"image {image.ref}: its User {user!r} is out of range")
    return None if uid == 0 else (uid, gid)


def _table(image: CachedImage, path: str) -> dict[str, tuple[int, int]]:
    """name -> (id, group id) of the image's passwd (or id, id of its group file);
    absent: empty. Read only where it resolves inside the image: a link out of it
    would have treadle read a host file."""
    rootfs = os.path.realpath(image.rootfs)
    real = os.path.realpath(os.path.join(rootfs, path.lstrip("/")))
    if os.path.commonpath([rootfs, real]) != rootfs:
        raise SandboxImageError(f"image {image.ref}: its {path} leads out of the image")
    try:
        with open(real, encoding="utf-8", errors="replace") as f:
            lines = f.read(_MAX_TABLE_BYTES).splitlines()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise SandboxImageError(f"image {image.ref}: cannot read its {path}: {e}") from None
    table: dict[str, tuple[int, int]] = {}
    for line in lines:  # passwd: name:x:uid:gid:...; group: name:x:gid:members
        fields = line.split(":")
        if len(fields) >= 3 and fields[2].isdigit():
            gid = fields[3] if path == "/etc/passwd" and len(fields) > 3 else fields[2]
            table.setdefault(fields[0], (int(fields[2]), int(gid) if gid.isdigit() else 0))
    return table


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

"""The `local` backend: plain child processes with limits, for development only.

It isolates NOTHING. Commands run as the calling user with the host's file system,
network and processes in full view; they can read your SSH keys and environment
files, talk to the internet and kill your other processes. It exists so that tool
code can be developed on machines without bubblewrap, and it says so once per
process (logging.warning).

What it does give, like bwrap: the rlimits of `Limits` (RLIMIT_NPROC rebased, see
`_local_rlimits`), the cgroup memory/pids limits where the host lets us write
them (v1 or v2, see _cgroup.py), the wall-clock deadline, the output cap, a cleared environment (the
host PATH, HOME, LANG and the caller's `env` only), and the guarantee that no
process outlives its exec: a subreaper supervisor (`inside.reaper`) kills the
whole tree, setsid'd and double-forked processes included. Commands run in the work
dir, which is also their HOME.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from treadle.sandbox import _process, _workdir
from treadle.sandbox._cgroup import Cgroups, detect_cgroups
from treadle.sandbox._host import BASE_LANG, HostSandbox
from treadle.sandbox.base import Limits, Sandbox, SandboxBackend
from treadle.sandbox.inside import reaper

log = logging.getLogger(__name__)

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_warned = False


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("treadle sandbox backend 'local' does not isolate anything: commands "
                    "see the host's files, network and processes. Use it for development only.")


class LocalSandbox(HostSandbox):
    """A work dir on the host; commands run in it under the reaper."""

    @property
    def workdir(self) -> str:
        return self.host_dir

    def _base_env(self) -> dict[str, str]:
        # The host PATH, so that a developer's tools are found; nothing else leaks.
        return {"PATH": os.environ.get("PATH", _DEFAULT_PATH), "HOME": self.host_dir,
                "LANG": BASE_LANG}

    def _launch(self, argv: list[str], env: dict[str, str]) -> _process.Launch:
        spec = reaper.format_spec(_local_rlimits(self.limits))
        return _process.Launch(
            argv=[sys.executable, "-I", "-S", os.path.abspath(reaper.__file__), spec, "--", *argv],
            env=env,
            cwd=self.host_dir,
            kill_tree=_stop_reaper,
        )


def _local_rlimits(limits: Limits) -> list[tuple[str, int, int]]:
    """The rlimits, with RLIMIT_NPROC rebased for a shared user.

    Without a user namespace the kernel counts *all* processes of the real uid
    against RLIMIT_NPROC, so a plain max_processes would forbid any fork on a
    developer's machine. The limit is set to what the user runs now plus
    max_processes: a bound on the exec's growth, racy against the user's other
    processes. Root is exempt from RLIMIT_NPROC; there only the pids cgroup counts.
    """
    out = []
    for name, soft, hard in limits.rlimits():
        if name == "NPROC" and os.geteuid() != 0:
            soft = hard = _processes_of(os.getuid()) + limits.max_processes
        out.append((name, soft, hard))
    return out


def _processes_of(uid: int) -> int:
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                continue
    return count


def _stop_reaper(pid: int) -> None:
    """Ask the reaper to kill its tree; SIGKILL would orphan the tree instead."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


class LocalBackend(SandboxBackend):
    """Makes `LocalSandbox`es under `work_root` (default: `_workdir.default_work_root()`)."""

    name = "local"

    def __init__(self, *, work_root: str | None = None, use_cgroups: bool = True) -> None:
        self.work_root = work_root or _workdir.default_work_root()
        self._use_cgroups = use_cgroups
        self._swept = False

    def _cgroups(self) -> Cgroups | None:
        return detect_cgroups() if self._use_cgroups else None

    async def start(self, limits: Limits) -> Sandbox:
        _warn_once()
        cgroups = self._cgroups()
        if not self._swept:  # once per backend: what a crashed predecessor left
            await asyncio.to_thread(_workdir.ensure_work_root, self.work_root, traversable=False)
            self._swept = True
            await asyncio.to_thread(_workdir.sweep_stale_workdirs, self.work_root)
            if cgroups is not None:
                cgroups.sweep()
        # Synchronous (one mkdir): no await between creating the dir and owning it,
        # so a cancelled start cannot leak it.
        host_dir = _workdir.create_workdir(self.work_root, None, None)
        return LocalSandbox(host_dir=host_dir, limits=limits, cgroups=cgroups, owner=None)

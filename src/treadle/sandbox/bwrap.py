"""The `bwrap` backend: rootless bubblewrap namespaces, a system-call filter, rlimits, cgroups.

Each exec is one fresh `bwrap` process tree:

- Namespaces: all of them (`--unshare-all --unshare-user`): own pid namespace (no
  host process is visible or signallable), own network namespace with only a
  loopback of its own (no egress, no reaching host services on 127.0.0.1), own
  IPC, UTS and cgroup namespaces; `--disable-userns` forbids nested user
  namespaces (less kernel surface); `--new-session` (no TIOCSTI into a terminal);
  `--die-with-parent`.
- Identity: when treadle runs as root the sandbox runs as an unprivileged uid
  (65534 by default), so host file permissions apply, RLIMIT_NPROC is enforced and
  no capability exists anywhere. If this host forbids unprivileged user namespaces
  it falls back, with a warning, to host root with every capability dropped. A
  non-root treadle runs sandboxes as itself.
- System calls: the seccomp filter of `_seccomp.py` (no ptrace or process_vm_* of
  anything, no kernel keyrings, none of a list of calls no tool needs), loaded by
  bwrap into its pid 1 and the command. Without libseccomp, none (a warning).
- File system (see _view.py): a new root holding the host's system directories
  read-only and any `expose` path; everything else of the host (/home, /root,
  /tmp, /run, /var, /sys, any top-level directory nobody thought of) does not
  exist inside: default deny. The caller's working directory, treadle's source
  checkout, the password/ssh/sudo files of /etc and any `hide` path are covered.
  A fresh /proc (/proc/1 and the key lists covered), a minimal read-only /dev, a
  /dev/shm and a /tmp of their own per exec, each `memory_mb` in size; the work
  dir bound read-write at `mount_point` (default /work), the cwd and HOME.
  With an `image`, the image's root file system takes the place of the host's
  system directories (read-only; its Env set, the work dir at its WorkingDir as a
  private copy of the image's; `prlimit` and the agent's python3 are the image's):
  see treadle.sandbox.images and _image_root.py.
- Environment: cleared (`--clearenv`), then PATH, HOME, LANG and the caller's `env`.
  The bwrap options travel in a memfd (`--args`), so they are not in any cmdline.
- Limits: the gate sets the CPU, file-size, fd, core and address-space rlimits on
  the outer bwrap, so that every process of the tree, pid 1 included, holds them;
  `prlimit` inside sets them again with RLIMIT_NPROC, after the user namespace
  exists, so that RLIMIT_NPROC counts only the sandbox's own processes; cgroup
  memory and pids groups per exec where writable, v1 or v2 (see _cgroup.py).
- Supervision: bwrap writes the command's exit status to `--json-status-fd`; a
  bwrap killed from outside, or one that exits without having started the
  command, makes `exec` raise SandboxSupervisorError (see _process.py).
- Executor (default `executor="resident"`): one bwrap launch per sandbox, built
  as above, whose command (pid 1, `--as-pid-1`) runs every call in the namespaces
  already built; see _resident.py for what that changes. `executor="per-call"`
  (or a bwrap without `--as-pid-1`, or no python3 under /usr) launches bwrap per exec.
- Teardown: killing the outer bwrap makes the namespace's init die
  (PR_SET_PDEATHSIG), and the kernel then kills every process in the pid
  namespace, whatever it forked or daemonised; no process inside can reach pid 1
  to clear that signal.

What it does not protect against is in docs/sandbox.md; the short version: kernel
exploits through the system calls the filter allows, side channels,
world-readable files in the visible system directories, exhaustion of shared
kernel resources, and, unless `bounded_workdirs` is on (and treadle may mount),
the total disk use of the work dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from treadle.errors import SandboxError, SandboxImageError, SandboxUnavailable
from treadle.sandbox import _image_root, _process, _resident, _seccomp, _workdir
from treadle.sandbox._cgroup import Cgroups, detect_cgroups
from treadle.sandbox._host import BASE_LANG, HostSandbox
from treadle.sandbox._seccomp import SyscallFilter, syscall_filter
from treadle.sandbox._view import FileView, file_view
from treadle.sandbox.base import MIB, ExecResult, Limits, Sandbox, SandboxBackend
from treadle.sandbox.images import CachedImage, ImageCache, default_cache

log = logging.getLogger(__name__)

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NOBODY = (65534, 65534)
_PRLIMIT_OPTION = {"CPU": "--cpu", "NPROC": "--nproc", "FSIZE": "--fsize",
                   "NOFILE": "--nofile", "CORE": "--core", "AS": "--as"}
# Set on the outer bwrap too, so that its pid 1 holds them. Not RLIMIT_NPROC: set
# before the user namespace exists, it would count every process of the sandbox
# uid on the host (all sandboxes together), since the kernel checks a new user
# namespace's processes against its creator's limit at the parent level too.
_OUTER = ("CPU", "FSIZE", "NOFILE", "CORE", "AS")
_SELF_TEST_TIMEOUT_S = 20.0
_INSTALL_HINT = ("install bubblewrap: `bash scripts/system-deps.sh bubblewrap` "
                 "(or apt-get install bubblewrap)")


@dataclass(frozen=True, slots=True)
class _Setup:
    """What the first start found out about this host; fixed afterwards."""

    bwrap: str  # absolute path of the bwrap binary
    prlimit: str  # absolute path of prlimit (visible inside: /usr is bound)
    run_as: tuple[int, int] | None  # (uid, gid) bwrap is started as; None = as ourselves
    drop_caps: bool  # bwrap runs as host root: drop every capability inside
    disable_userns: bool  # this bwrap supports --disable-userns
    tmpfs_size: bool  # this bwrap supports --size
    json_status: bool  # this bwrap supports --json-status-fd (reports the command's status)
    masks: tuple[str, ...]  # host paths covered with an empty tmpfs
    seccomp: SyscallFilter | None  # the system-call filter; None without libseccomp
    resident_python: str | None = None  # python3 for the resident executor; None: per-call
    view: FileView | None = None  # the file view when it is not the backend's (an image's)
    image: CachedImage | None = None  # the image sandboxes run on; None: the host's dirs
    ids: tuple[int, int] | None = None  # (uid, gid) inside, from the image's User; None: ours


class BwrapSandbox(HostSandbox):
    """One work dir, bound at the backend's mount point for every exec."""

    def __init__(self, *, backend: BwrapBackend, setup: _Setup, host_dir: str, limits: Limits,
                 cgroups: Cgroups | None) -> None:
        super().__init__(host_dir=host_dir, limits=limits, cgroups=cgroups, owner=setup.run_as)
        self._backend = backend
        self._setup = setup
        self._resident = None if setup.resident_python is None else _resident.ResidentExecutor(
            launch=self._launch_resident, limits=limits, cgroups=cgroups)

    @property
    def workdir(self) -> str:
        return self._backend.mount_point

    @property
    def workdir_bounded(self) -> bool:
        """Whether the work dir is a tmpfs of `Limits.workdir_mb` and `workdir_files`."""
        return _workdir.workdir_bounded(self.host_dir)

    def _base_env(self) -> dict[str, str]:
        return _image_root.image_env(self._setup.image,
                                     {"PATH": SANDBOX_PATH, "LANG": BASE_LANG, "TMPDIR": "/tmp"},
                                     home=self.workdir)

    @property
    def keeps_python_session(self) -> bool:
        return self._resident is not None and not self._resident.broken

    async def run_cell(self, code: bytes, *, timeout_s: float, python: str = "python3",
                       env: Mapping[str, str] | None = None) -> ExecResult:
        if not self.keeps_python_session:
            return await super().run_cell(code, timeout_s=timeout_s, python=python, env=env)
        argv, merged, timeout = self._checked([python, *_resident.PYTHON_ARGV[1:]],
                                              timeout_s, env)
        assert self._resident is not None
        return await self._submit(self._resident.cell(argv, merged, timeout, bytes(code)))

    async def _run(self, argv: list[str], env: dict[str, str], timeout_s: float,
                   stdin: bytes | None) -> ExecResult:
        resident = self._resident
        if resident is not None and not resident.broken and not resident.busy:
            result = await resident.run(argv, env, timeout_s, stdin)
            if result is not None:
                return result
        return await super()._run(argv, env, timeout_s, stdin)  # concurrent, or no executor

    async def _finish_close(self, running: list[asyncio.Task[ExecResult]]) -> None:
        if self._resident is not None:
            await asyncio.gather(*running, return_exceptions=True)
            await self._resident.close()
        await super()._finish_close(running)

    def _launch_resident(self, sock_fd: int) -> _process.Launch:
        assert self._setup.resident_python is not None
        return self._launch(_resident.agent_command(self._setup.resident_python, sock_fd),
                            self._base_env(), extra_fds=(sock_fd,), resident=True)

    def _launch(self, argv: list[str], env: dict[str, str], *, extra_fds: tuple[int, ...] = (),
                resident: bool = False) -> _process.Launch:
        prlimit = [self._setup.prlimit, *(f"{_PRLIMIT_OPTION[name]}={soft}:{hard}"
                                          for name, soft, hard in self.limits.rlimits())]
        outer = tuple((getattr(resource, f"RLIMIT_{name}"), soft, hard)
                      for name, soft, hard in self.limits.rlimits() if name in _OUTER)
        # All CLOEXEC: pass_fds opens them to this bwrap only, not to other host children.
        opened: list[int] = []
        status_read = status_write = None
        try:
            if self._setup.json_status and not resident:  # the agent reports statuses
                status_read, status_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                opened += (status_read, status_write)
            seccomp_fd = None
            if self._setup.seccomp is not None:
                # The resident launch: also no changing another process's rlimits,
                # nice or scheduling (pid 1 and the zygote outlive a call).
                program = (_seccomp.resident_filter() or self._setup.seccomp) if resident \
                    else self._setup.seccomp
                seccomp_fd = program.open_fd()
                opened.append(seccomp_fd)
            options = self._backend.bwrap_options(self._setup, self.host_dir, env, self.limits,
                                                  seccomp_fd=seccomp_fd, status_fd=status_write,
                                                  as_pid_1=resident)
            args_fd = os.memfd_create("treadle-bwrap-args", os.MFD_CLOEXEC)
            opened.append(args_fd)
            payload = b"".join(opt.encode() + b"\0" for opt in options)
            view = memoryview(payload)
            while view:
                view = view[os.write(args_fd, view):]
            os.lseek(args_fd, 0, os.SEEK_SET)
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return _process.Launch(
            argv=[self._setup.bwrap, "--args", str(args_fd), "--", *prlimit, "--", *argv],
            env={"PATH": SANDBOX_PATH},
            cwd="/",
            user=self._setup.run_as,
            pass_fds=(*(fd for fd in opened if fd != status_read), *extra_fds),
            signalled_by_status=True,
            kill_tree=_kill_bwrap,
            outer_rlimits=outer,
            status_fd=status_read,
        )


def _kill_bwrap(pid: int) -> None:
    """SIGKILL the outer bwrap: its init dies with it, and with the init the pid namespace."""
    for kill in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


class BwrapBackend(SandboxBackend):
    """Makes `BwrapSandbox`es.

    mount_point: where the work dir appears inside; one top-level path ("/work").
    work_root: host directory for work dirs (default /var/lib/treadle/sandboxes for
        root, else <tmp>/treadle-sandboxes-<uid>); refused unless private to this
        user (see _workdir.py).
    expose: extra host paths (absolute) to show read-only at the same place, e.g.
        "/nix/store", a read-only dataset directory or a virtualenv under /tmp; not
        /tmp as a whole, nor /proc, /dev or the mount point or under them.
    hide: extra host paths to cover (files or directories) besides the defaults.
    sandbox_user: (uid, gid) sandboxes run as when treadle is root; None keeps root
        (capabilities dropped). Ignored when treadle is not root.
    use_cgroups: use cgroup (v1 or v2) memory/pids limits where writable.
    bounded_workdirs: make each work dir a tmpfs of `Limits.workdir_mb` and
        `workdir_files` where treadle may mount (root); else plain directories. Off
        by default: each tmpfs is a mount in the host's mount table, which every
        exec's new mount namespace copies and tears down, so with N live sandboxes
        every exec pays for N more mounts (docs/sandbox.md has the numbers).
    image: an environment image (a root file system dir, an OCI layout dir, or an
        OCI/docker tar archive; see treadle.sandbox.images) whose root file system
        sandboxes see as `/`, read-only, instead of the host's system dirs; its Env
        is set and, when it names a WorkingDir, the work dir is mounted there as a
        private copy of the image's (`_image_root.py`); `mount_point` otherwise.
        Unpacked (once per host) on the first start; SandboxImageError if unusable.
    image_cache: where images are unpacked (default: `images.default_cache()`).
    """

    name = "bwrap"

    def __init__(
        self,
        *,
        mount_point: str = "/work",
        work_root: str | None = None,
        expose: Sequence[str] = (),
        hide: Sequence[str] = (),
        sandbox_user: tuple[int, int] | None = NOBODY,
        use_cgroups: bool = True,
        bounded_workdirs: bool = False,
        executor: str = "resident",
        image: str | None = None,
        image_cache: ImageCache | None = None,
    ) -> None:
        if executor not in ("resident", "per-call"):
            raise ValueError(f"executor must be 'resident' or 'per-call', got {executor!r}")
        self.executor = executor
        self.view = file_view(mount_point, expose, hide)
        self.work_root = work_root or _workdir.default_work_root()
        self.sandbox_user = sandbox_user
        self._use_cgroups = use_cgroups
        self._bounded_workdirs = bounded_workdirs
        self.image = image
        self.image_cache = image_cache
        self._setup: _Setup | None = None
        self._setup_lock = asyncio.Lock()

    def with_image(self, image: str | None) -> BwrapBackend:
        """A backend with this one's options and image cache whose sandboxes run on
        `image` (None: the host's dirs); it opens the image on its first start."""
        other = copy.copy(self)
        other.image = image
        other._setup = None
        other._setup_lock = asyncio.Lock()
        return other

    @property
    def mount_point(self) -> str:
        """Where the work dir appears (with an image: known once a sandbox has started)."""
        return self._view(self._setup).mount_point

    @property
    def cached_image(self) -> CachedImage | None:
        """The image sandboxes run on, once the first start has opened it; else None."""
        return self._setup.image if self._setup is not None else None

    def _view(self, setup: _Setup | None) -> FileView:
        return setup.view if setup is not None and setup.view is not None else self.view

    @property
    def isolation(self) -> str:
        """How sandboxes run here: 'unprivileged-uid', 'root-no-caps', 'self' or 'unknown'."""
        if self._setup is None:
            return "unknown"
        if self._setup.run_as is not None:
            return "unprivileged-uid"
        return "root-no-caps" if self._setup.drop_caps else "self"

    @property
    def syscall_filter(self) -> str:
        """'seccomp' when sandboxes run under the filter of _seccomp.py, 'none', or 'unknown'."""
        if self._setup is None:
            return "unknown"
        return "seccomp" if self._setup.seccomp is not None else "none"

    @property
    def cgroup_controllers(self) -> tuple[str, ...]:
        """The cgroup controllers each exec gets a group of (memory, pids), or ()."""
        cgroups = detect_cgroups() if self._use_cgroups else None
        return cgroups.controllers if cgroups is not None else ()

    async def prepare(self) -> None:
        await self._ensure_setup()

    async def start(self, limits: Limits) -> Sandbox:
        setup = await self._ensure_setup()
        cgroups = detect_cgroups() if self._use_cgroups else None
        if setup.image is not None and setup.image.config.working_dir not in (None, "/"):
            host_dir = await _image_root.seeded_workdir(self.work_root, setup.run_as,
                                                        self._quota(limits), setup.image)
        else:
            # Synchronous (mkdir, chown, mount): a cancelled start cannot leak the dir.
            host_dir = _workdir.create_workdir(self.work_root, setup.run_as, self._quota(limits))
        return BwrapSandbox(backend=self, setup=setup, host_dir=host_dir, limits=limits,
                            cgroups=cgroups)

    def _quota(self, limits: Limits) -> _workdir.Quota | None:
        if not self._bounded_workdirs:
            return None
        return _workdir.Quota(size_bytes=limits.workdir_mb * MIB, inodes=limits.workdir_files)

    # -- setup ----------------------------------------------------------------

    async def _ensure_setup(self) -> _Setup:
        async with self._setup_lock:
            if self._setup is None:
                self._setup = await self._probe()
            return self._setup

    async def _probe(self) -> _Setup:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(f"bwrap not found on PATH; {_INSTALL_HINT}")
        root = os.geteuid() == 0
        image, view = await self._open_image(root)
        prlimit = shutil.which("prlimit", path=SANDBOX_PATH) if image is None \
            else _image_root.image_prlimit(image)
        if prlimit is None or not prlimit.startswith(("/usr/", "/bin/", "/sbin/")):
            raise SandboxUnavailable("prlimit (util-linux) not found under /usr, /bin or /sbin")
        await asyncio.to_thread(_workdir.ensure_work_root, self.work_root,
                                traversable=root and self.sandbox_user is not None)
        # What a crashed predecessor left behind (only once the root is known to be ours).
        await asyncio.to_thread(_workdir.sweep_stale_workdirs, self.work_root)
        cgroups = detect_cgroups() if self._use_cgroups else None
        if cgroups is not None:
            cgroups.sweep()
        help_text = await asyncio.to_thread(_bwrap_help, bwrap)
        seccomp = await asyncio.to_thread(syscall_filter)
        candidates: list[tuple[tuple[int, int] | None, bool]] = []
        if root and self.sandbox_user is not None:
            candidates.append((self.sandbox_user, False))
        candidates.append((None, root))
        failures: list[str] = []
        for run_as, drop_caps in candidates:
            setup = _Setup(
                bwrap=bwrap, prlimit=prlimit, run_as=run_as, drop_caps=drop_caps,
                disable_userns="--disable-userns" in help_text,
                tmpfs_size="--size" in help_text,
                json_status="--json-status-fd" in help_text,
                masks=(view or self.view).masks(run_as),
                seccomp=seccomp,
                resident_python=self._resident_python(help_text, image),
                view=view,
                image=image,
                ids=None if image is None else _image_root.image_ids(image),
            )
            failure = await self._self_test(setup)
            if failure and seccomp is not None and "seccomp" in failure.lower():
                # A kernel without CONFIG_SECCOMP_FILTER: run unfiltered rather than not at all.
                unfiltered = dataclasses.replace(setup, seccomp=None)
                if not await self._self_test(unfiltered):
                    log.warning("this kernel refuses bwrap's seccomp filter (%s): sandboxes "
                                "run without a system-call filter", failure)
                    failure, setup = "", unfiltered
            if not failure:
                if failures:
                    log.warning("bwrap cannot run sandboxes as an unprivileged uid here (%s); "
                                "they run as host root with every capability dropped instead "
                                "(RLIMIT_NPROC is not enforced, root-readable files are "
                                "visible)", failures[0])
                return setup
            who = f"uid {run_as[0]}" if run_as is not None else "root" if root else "self"
            failures.append(f"as {who}: {failure}")
        raise SandboxUnavailable("bwrap cannot start a sandbox on this host: "
                                 + "; ".join(failures))

    async def _open_image(self, root: bool) -> tuple[CachedImage | None, FileView | None]:
        """The backend's image, unpacked if need be, and the file view on it."""
        if self.image is None:
            return None, None
        cache = self.image_cache or default_cache()
        image = await asyncio.to_thread(cache.open, self.image)
        try:
            view = self.view.for_image(image.rootfs, image.config.working_dir)
        except ValueError as e:
            raise SandboxImageError(f"image {self.image}: {e}") from None
        if root and self.sandbox_user is not None \
                and not _workdir.traversable(image.rootfs, *self.sandbox_user):
            raise SandboxImageError(f"image {self.image}: the sandbox uid "
                                    f"{self.sandbox_user[0]} cannot reach its root file system "
                                    f"{image.rootfs}; keep images where every user may "
                                    "traverse (e.g. the default /var/cache/treadle/images)")
        return image, view

    def _resident_python(self, help_text: str, image: CachedImage | None) -> str | None:
        python = shutil.which("python3", path=SANDBOX_PATH) if image is None \
            else _image_root.image_python(image)
        if self.executor != "resident" or "--as-pid-1" not in help_text or python is None \
                or not python.startswith(("/usr/", "/bin/")):
            return None
        return python

    async def _self_test(self, setup: _Setup) -> str:
        """'' if a trivial command runs in a sandbox with this setup, else bwrap's complaint."""
        host_dir = _workdir.create_workdir(self.work_root, setup.run_as, None)
        sandbox = BwrapSandbox(backend=self, setup=setup, host_dir=host_dir,
                               limits=Limits(), cgroups=None)
        try:
            result = await sandbox.exec(["/bin/sh", "-c", "exit 0"], timeout_s=_SELF_TEST_TIMEOUT_S)
        except OSError as e:
            return f"cannot start bwrap: {e}"
        except SandboxError as e:  # bwrap failed before the command ran
            return str(e)
        finally:
            await sandbox.close()
        if result.ok:
            return ""
        return (result.stderr.strip().splitlines() or [f"exit {result.exit_code}, "
                                                       f"killed {result.killed}"])[-1]

    def bwrap_options(self, setup: _Setup, host_dir: str, env: dict[str, str], limits: Limits,
                      *, seccomp_fd: int | None = None, status_fd: int | None = None,
                      as_pid_1: bool = False) -> list[str]:
        """The bwrap options (everything before the command) for one exec."""
        opts = ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
                "--hostname", "sandbox", *(["--as-pid-1"] if as_pid_1 else [])]
        if setup.ids is not None:
            opts += ["--uid", str(setup.ids[0]), "--gid", str(setup.ids[1])]
        if setup.disable_userns:
            opts.append("--disable-userns")
        if setup.drop_caps:
            opts += ["--cap-drop", "ALL"]
        if seccomp_fd is not None:
            opts += ["--seccomp", str(seccomp_fd)]
        if status_fd is not None:
            opts += ["--json-status-fd", str(status_fd)]
        opts.append("--clearenv")
        for key, value in env.items():
            opts += ["--setenv", key, value]
        return [*opts, *self._view(setup).options(host_dir=host_dir, masks=setup.masks,
                                          scratch_bytes=limits.memory_mb * MIB,
                                          sized=setup.tmpfs_size, mqueue=as_pid_1)]


def _bwrap_help(bwrap: str) -> str:
    proc = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10,
                          check=False)
    return proc.stdout + proc.stderr

"""The system-call filter of bwrap sandboxes: a seccomp program compiled by libseccomp.

bwrap loads the program (`--seccomp FD`) into its pid 1 and into the command just
before the exec, so every process of the sandbox runs under it and cannot drop
it. Default action: allow. Denied (the call fails, the process lives on):

- *Reaching into other processes*: `ptrace`, `process_vm_readv/writev`,
  `process_madvise`, `pidfd_getfd`, `kcmp`, `move_pages`, `migrate_pages`. Every
  process of a sandbox runs as one uid, so without this a command could steer
  bwrap's pid 1 (which holds no RLIMIT_NPROC and the namespace's death signal) or
  read its siblings' memory. (`/proc/1` is also covered, see bwrap.py, because
  opening `/proc/PID/mem` needs no system call that could be denied here.)
- *Kernel keyrings*: `add_key`, `request_key`, `keyctl`. Keyrings are not
  namespaced: the caller's session keyring is inherited across fork, exec and
  setuid, and keys of one uid are shared by every sandbox running as that uid.
- *Kernel attack surface no tool call needs*, the usual first step of a local
  kernel exploit: `bpf`, `perf_event_open`, `userfaultfd` (stretches race
  windows), `io_uring_*` (fails with ENOSYS, so runtimes fall back to plain I/O),
  `fanotify_init`, `lookup_dcookie`, `open_by_handle_at`.
- *Administering the host* (each needs a capability the sandbox lacks; denied so
  that a capability bug is not enough): module loading, kexec, reboot, swap, acct,
  quotas, the kernel log, setting the clock, x86 port I/O, vhangup, and the mount
  family (`mount`, `umount2`, `pivot_root`, `chroot`, the new mount API) with
  `unshare` and `setns`; and new namespaces by the other door, `clone` with any
  `CLONE_NEW*` flag (on bwraps without `--disable-userns` a command could otherwise
  still make user namespaces), while `clone3`, whose flags sit in memory a filter
  cannot read, fails with ENOSYS so that libc falls back to `clone`.
- `personality` calls that set ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC or
  MMAP_PAGE_ZERO (exploit aids); one comparison per rule cannot tell the
  read-only query `personality(0xffffffff)` from those, so it is refused too.
- `ioctl` TIOCSTI and TIOCLINUX (typing into a terminal; compared on the low 32
  bits, as the kernel reads the argument), and `socket(AF_VSOCK)`: vsock reaches
  the hypervisor of a VM and is not confined by the network namespace.

The resident executor's launch (see _resident.py) adds, with `resident=True`:
changing another process's scheduling, nice value, I/O priority or rlimits:
`prlimit64` with a pid other than 0 and a new limit, `setpriority` other than
(PRIO_PROCESS, 0), `ioprio_set` other than (IOPRIO_WHO_PROCESS, 0), and
`sched_setscheduler`, `sched_setparam`, `sched_setattr`, `sched_setaffinity` with a
pid other than 0. There pid 1 and the python zygote outlive a call, and what a call
set on them would hold for the calls after it. Setting one's own (pid 0, as libc's
setrlimit, nice and the gate's `prlimit -- CMD` do) and reading anyone's stay allowed;
so does naming oneself by pid, the only loss (`renice -p $$` fails with EPERM).

System calls of another ABI (i386 via int 0x80, x32 on x86_64) kill the process:
libseccomp's architecture check, kept at its default.

Why libseccomp through ctypes: libseccomp (Debian's libseccomp2, a dependency of
apt and systemd) knows every architecture's system-call numbers and emits that
architecture check. Its official Python bindings are not on PyPI, Debian's
python3-seccomp is built for the system interpreter rather than a virtualenv, and
the PyPI ctypes wrapper (pyseccomp) has had no release since 2021 and no types; the
eight functions used here are bound directly. Without libseccomp, `syscall_filter()`
returns None and sandboxes run unfiltered (logged as a warning).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

_ACT_ALLOW = 0x7FFF0000
_ACT_KILL_PROCESS = 0x80000000
_ATTR_ACT_BADARCH = 2  # enum scmp_filter_attr
_ATTR_CTL_OPTIMIZE = 8
_OPTIMIZE_BINARY_TREE = 2
_CMP_NE = 1  # enum scmp_compare
_CMP_MASKED_EQ = 7
_LOW32 = 0xFFFFFFFF

# libseccomp's architecture tokens (the AUDIT_ARCH_* values) of the machines bwrap runs on.
_ARCH_NAMES = {0xC000003E: "x86_64", 0xC00000B7: "aarch64", 0x40000003: "x86",
               0x40000028: "arm", 0xC00000F3: "riscv64", 0xC0000015: "ppc64le",
               0x80000016: "s390x"}
# System calls numbered 424 and up have one number on these architectures; used for
# calls newer than the installed libseccomp (which then does not know their names).
_COMMON_NUMBERS_ON = {"x86_64", "aarch64", "riscv64", "s390x", "ppc64le"}
_COMMON_NUMBERS = {"clone3": 435, "pidfd_getfd": 438, "process_madvise": 440, "io_uring_setup": 425,
                   "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
                   "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
                   "fspick": 433, "mount_setattr": 442, "quotactl_fd": 443}

_CROSS_PROCESS = ("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise",
                  "pidfd_getfd", "kcmp", "move_pages", "migrate_pages")
_KEYRINGS = ("add_key", "request_key", "keyctl")
_ATTACK_SURFACE = ("bpf", "perf_event_open", "userfaultfd", "fanotify_init", "lookup_dcookie",
                   "open_by_handle_at")
_HOST_ADMIN = ("init_module", "finit_module", "delete_module", "create_module", "kexec_load",
               "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl",
               "quotactl_fd", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
               "iopl", "ioperm", "vhangup", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl")
_MOUNTS = ("mount", "umount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
           "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns")
_IO_URING = ("io_uring_setup", "io_uring_enter", "io_uring_register")
DENIED: tuple[str, ...] = (*_CROSS_PROCESS, *_KEYRINGS, *_ATTACK_SURFACE, *_HOST_ADMIN, *_MOUNTS,
                           *_IO_URING)

_PERSONALITY_BITS = (0x0040000, 0x0400000, 0x0100000)  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC,
#                                                        MMAP_PAGE_ZERO
_TERMINAL_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX
_AF_VSOCK = 40
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
# CLONE_NEWNET; one rule each (a rule compares one masked value).
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
              0x40000000)


@dataclass(frozen=True, slots=True)
class SyscallFilter:
    """One compiled program, fixed for the life of the process."""

    program: bytes  # struct sock_filter[], as bwrap's --seccomp reads it
    arch: str  # the native architecture it checks for
    denied: tuple[str, ...]  # the calls it refuses outright on this architecture
    unknown: tuple[str, ...]  # listed calls that do not exist here (nothing to deny)

    def open_fd(self) -> int:
        """A fresh fd at offset 0 holding the program (close-on-exec; bwrap reads it to EOF)."""
        return memfd("treadle-seccomp", self.program)


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = (("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64))


class _Compiler:
    """The few libseccomp calls used, with their C signatures; one filter context."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.seccomp_init.argtypes = (ctypes.c_uint32,)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_release.argtypes = (ctypes.c_void_p,)
        lib.seccomp_release.restype = None
        lib.seccomp_attr_set.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32)
        lib.seccomp_rule_add_array.argtypes = (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                               ctypes.c_uint, ctypes.POINTER(_ArgCmp))
        lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
        lib.seccomp_arch_native.restype = ctypes.c_uint32
        lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
        self.lib = lib
        ctx = lib.seccomp_init(_ACT_ALLOW)
        if not ctx:
            raise OSError(errno.ENOMEM, "seccomp_init failed")
        self.ctx: int = ctx
        self.arch = _ARCH_NAMES.get(int(lib.seccomp_arch_native()), "unknown")
        self._check(lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, _ACT_KILL_PROCESS),
                    "seccomp_attr_set")
        # A binary search over the call numbers instead of a chain: the kernel runs the
        # program for each call number when it loads it (twice per exec, pid 1 and the
        # command), and on every call whose verdict depends on its arguments.
        # libseccomp before 2.5 knows no such attribute; a chain is as correct.
        lib.seccomp_attr_set(ctx, _ATTR_CTL_OPTIMIZE, _OPTIMIZE_BINARY_TREE)

    def number(self, name: str) -> int | None:
        """The native number of a call, or None if it does not exist here."""
        nr = int(self.lib.seccomp_syscall_resolve_name(name.encode()))
        if nr >= 0:
            return nr
        if self.arch in _COMMON_NUMBERS_ON:
            return _COMMON_NUMBERS.get(name)
        return None

    def deny(self, nr: int, err: int, arg: int | None = None, mask: int = 0,
             value: int = 0) -> None:
        """Fail call `nr` with `err`; only when (argument `arg` & mask) == value, if given."""
        action = 0x00050000 | err  # SCMP_ACT_ERRNO(err)
        if arg is None:
            rc = self.lib.seccomp_rule_add_array(self.ctx, action, nr, 0, None)
        else:
            cmp = (_ArgCmp * 1)(_ArgCmp(arg, _CMP_MASKED_EQ, mask, value))
            rc = self.lib.seccomp_rule_add_array(self.ctx, action, nr, 1, cmp)
        self._check(rc, f"seccomp_rule_add({nr})")

    def deny_unless_zero(self, nr: int, err: int, *args: int) -> None:
        """Fail call `nr` with `err` when every one of arguments `args` is non-zero."""
        cmps = (_ArgCmp * len(args))(*(_ArgCmp(arg, _CMP_NE, 0, 0) for arg in args))
        action = 0x00050000 | err  # SCMP_ACT_ERRNO(err)
        self._check(self.lib.seccomp_rule_add_array(self.ctx, action, nr, len(args), cmps),
                    f"seccomp_rule_add({nr})")

    def export(self) -> bytes:
        fd = os.memfd_create("treadle-seccomp-build", os.MFD_CLOEXEC)
        try:
            self._check(self.lib.seccomp_export_bpf(self.ctx, fd), "seccomp_export_bpf")
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def release(self) -> None:
        self.lib.seccomp_release(self.ctx)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc < 0:
            raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


def _load_libseccomp() -> ctypes.CDLL | None:
    for name in ("libseccomp.so.2", ctypes.util.find_library("seccomp")):
        if name:
            try:
                return ctypes.CDLL(name, use_errno=True)
            except OSError:
                continue
    return None


def compile_filter(lib: ctypes.CDLL, *, resident: bool = False) -> SyscallFilter:
    """The program described in the module docstring, for this machine's architecture.

    OSError if libseccomp refuses a rule.
    """
    compiler = _Compiler(lib)
    try:
        denied: list[str] = []
        unknown: list[str] = []
        for name in DENIED:
            nr = compiler.number(name)
            if nr is None:
                unknown.append(name)
                continue
            compiler.deny(nr, errno.ENOSYS if name in _IO_URING else errno.EPERM)
            denied.append(name)
        personality = compiler.number("personality")
        if personality is not None:
            for bit in _PERSONALITY_BITS:
                compiler.deny(personality, errno.EPERM, arg=0, mask=bit, value=bit)
        ioctl = compiler.number("ioctl")
        if ioctl is not None:
            for request in _TERMINAL_IOCTLS:
                compiler.deny(ioctl, errno.EPERM, arg=1, mask=_LOW32, value=request)
        socket = compiler.number("socket")
        if socket is not None:
            compiler.deny(socket, errno.EAFNOSUPPORT, arg=0, mask=_LOW32, value=_AF_VSOCK)
        clone = compiler.number("clone")
        if clone is not None:
            flags = 1 if compiler.arch == "s390x" else 0  # s390x passes the stack first
            for bit in _CLONE_NEW:
                compiler.deny(clone, errno.EPERM, arg=flags, mask=bit, value=bit)
        clone3 = compiler.number("clone3")
        if clone3 is not None:
            compiler.deny(clone3, errno.ENOSYS)
        if resident:
            _deny_other_processes_settings(compiler)
        return SyscallFilter(program=compiler.export(), arch=compiler.arch,
                             denied=tuple(denied), unknown=tuple(unknown))
    finally:
        compiler.release()


# (name, rules): each rule a tuple of argument indexes; the call fails when all of
# one rule's arguments are non-zero. prlimit64(pid, resource, new, old);
# setpriority(which, who, prio): PRIO_PROCESS is 0; ioprio_set(which, who, prio):
# `who` must be 0, and `which` IOPRIO_WHO_PROCESS (1; 2 and 3 refused below).
_OTHER_PROCESS_SETTINGS = (("prlimit64", ((0, 2),)), ("setpriority", ((0,), (1,))),
                           ("sched_setscheduler", ((0,),)), ("sched_setparam", ((0,),)),
                           ("sched_setattr", ((0,),)), ("sched_setaffinity", ((0,),)),
                           ("ioprio_set", ((1,),)))


def _deny_other_processes_settings(compiler: _Compiler) -> None:
    for name, rules in _OTHER_PROCESS_SETTINGS:
        nr = compiler.number(name)
        if nr is None:
            continue
        for args in rules:
            compiler.deny_unless_zero(nr, errno.EPERM, *args)
    ioprio_set = compiler.number("ioprio_set")
    if ioprio_set is not None:  # which other than IOPRIO_WHO_PROCESS (pgrp, user)
        for which in (2, 3):
            compiler.deny(ioprio_set, errno.EPERM, arg=0, mask=_LOW32, value=which)


@functools.cache
def resident_filter() -> SyscallFilter | None:
    """The filter with `resident=True`, compiled once; None where there is none."""
    lib = _load_libseccomp()
    if lib is None:
        return None
    try:
        return compile_filter(lib, resident=True)
    except (OSError, AttributeError):
        return None


@functools.cache
def syscall_filter() -> SyscallFilter | None:
    """This machine's filter, compiled once; None (a warning, once) without libseccomp."""
    lib = _load_libseccomp()
    if lib is None:
        log.warning("libseccomp not found (install libseccomp2): bwrap sandboxes run without a "
                    "system-call filter, so they can ptrace each other's processes, use kernel "
                    "keyrings and reach every system call an unprivileged process can")
        return None
    try:
        found = compile_filter(lib)
    except (OSError, AttributeError) as e:  # AttributeError: a libseccomp without a function
        log.warning("libseccomp cannot compile the sandbox filter (%s): bwrap sandboxes run "
                    "without a system-call filter", e)
        return None
    log.debug("sandbox seccomp filter for %s: %d instructions, %d calls denied, unknown here: "
              "%s", found.arch, len(found.program) // 8, len(found.denied),
              ", ".join(found.unknown) or "none")
    return found


def memfd(name: str, data: bytes) -> int:
    """A close-on-exec memfd at offset 0 holding `data` (what a reader takes to EOF)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd

"""Attack programs the battery runs inside sandboxes, and what the host needs to judge them.

Each probe is a Python program (python3 is visible inside) that tries one thing
per line of output, `<what> <outcome>`, outcome being `ok` or the errno name, so
a test can say exactly which attempt got through. System-call numbers come from
the host's libseccomp, so the probes hold on any architecture bwrap runs on.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_LIB = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
_LIB.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


def nr(name: str) -> int:
    """The native number of a system call (the sandbox runs on the host's architecture)."""
    value = int(_LIB.seccomp_syscall_resolve_name(name.encode()))
    assert value >= 0, name
    return value


def outcomes(stdout: str) -> dict[str, str]:
    """`<what> <outcome>` lines as a dict."""
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


_PRELUDE = """
import ctypes, errno, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def report(what, rc):
    print(what, "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()], flush=True)
def sys_(nr, *args):
    return libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
"""

# argv: ptrace process_vm_readv. Attaches to bwrap's pid 1 and to a child of its own.
PTRACE = _PRELUDE + """
PTRACE_TRACEME, PTRACE_ATTACH, PTRACE_SEIZE = 0, 16, 0x4206
ptrace, vm_readv = int(sys.argv[1]), int(sys.argv[2])
report("seize-pid1", sys_(ptrace, PTRACE_SEIZE, 1, 0, 0))
child = os.fork()
if child == 0:
    os.execvp("sleep", ["sleep", "30"])
report("attach-child", sys_(ptrace, PTRACE_ATTACH, child, 0, 0))
os.kill(child, 9)
os.waitpid(child, 0)
report("traceme", sys_(ptrace, PTRACE_TRACEME, 0, 0, 0))
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
remote = (ctypes.c_void_p * 2)(0x400000, 8)
report("vm-readv-pid1", sys_(vm_readv, 1, ctypes.addressof(iov), 1, ctypes.addressof(remote), 1, 0))
for path in ("/proc/1/mem", "/proc/1/task/1/mem"):
    try:
        os.close(os.open(path, os.O_RDWR))
        print(path, "ok")
    except OSError as e:
        print(path, errno.errorcode[e.errno])
"""

# argv: keyctl add_key [key id to read] [description to add]. Keyrings: -3 session, -4 user.
KEYS = _PRELUDE + """
keyctl, add_key = int(sys.argv[1]), int(sys.argv[2])
target, description = int(sys.argv[3]), sys.argv[4]
report("session-id", sys_(keyctl, 0, -3, 0))  # KEYCTL_GET_KEYRING_ID
buf = ctypes.create_string_buffer(256)
n = sys_(keyctl, 11, target, ctypes.addressof(buf), 256)  # KEYCTL_READ
report("read", n)
if n > 0:
    print("payload", buf.raw[:n].decode(errors="replace"))
found = sys_(keyctl, 10, -3, ctypes.addressof(ctypes.create_string_buffer(b"user")),
             ctypes.addressof(ctypes.create_string_buffer(b"treadle-probe")), 0)  # KEYCTL_SEARCH
report("search", found)
if found > 0:
    n = sys_(keyctl, 11, found, ctypes.addressof(buf), 256)
    if n > 0:
        print("payload", buf.raw[:n].decode(errors="replace"))
payload = ("left-by-" + description).encode()
for ring, name in ((-3, "add-session"), (-4, "add-user")):
    report(name, sys_(add_key, ctypes.addressof(ctypes.create_string_buffer(b"user")),
                      ctypes.addressof(ctypes.create_string_buffer(description.encode())),
                      ctypes.addressof(ctypes.create_string_buffer(payload)), len(payload), ring))
try:
    open("/proc/keys").read()
    print("proc-keys", "ok")
except OSError as e:
    print("proc-keys", errno.errorcode[e.errno])
"""

# argv: the numbers of the calls named below, in order. Each is made once, harmlessly.
SYSCALLS = _PRELUDE + """
names = ["bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "unshare", "mount",
         "personality", "kcmp", "clone", "clone3"]
n = dict(zip(names, map(int, sys.argv[1:])))
report("bpf", sys_(n["bpf"], 0, 0, 0))
attr = ctypes.create_string_buffer(128)
ctypes.memmove(attr, (ctypes.c_uint32 * 2)(1, 128), 8)  # PERF_TYPE_SOFTWARE, size
report("perf_event_open", sys_(n["perf_event_open"], ctypes.addressof(attr), 0, -1, -1, 0))
report("userfaultfd", sys_(n["userfaultfd"], 1))  # UFFD_USER_MODE_ONLY: no privilege needed
params = ctypes.create_string_buffer(120)
report("io_uring_setup", sys_(n["io_uring_setup"], 1, ctypes.addressof(params)))
report("unshare", sys_(n["unshare"], 0x200))  # CLONE_FS: harmless, allowed by the kernel
report("mount", sys_(n["mount"], 0, 0, 0, 0, 0))
report("personality", sys_(n["personality"], 0x0040000))  # ADDR_NO_RANDOMIZE
report("personality-plain", sys_(n["personality"], 0))
report("kcmp", sys_(n["kcmp"], os.getpid(), os.getpid(), 0, 0, 0))
for what, flags in (("clone-newuser", 0x10000000), ("clone-newnet", 0x40000000),
                    ("clone-plain", 0)):
    child = sys_(n["clone"], flags | 17, 0, 0, 0, 0)  # | SIGCHLD; no stack: like fork
    if child == 0:
        os._exit(0)  # the child, if there is one, leaves at once
    if child > 0:
        os.waitpid(child, 0)
        child = 0
    report(what, child)
report("clone3", sys_(n["clone3"], 0, 0))
try:
    socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK; never connected
    print("vsock ok")
except OSError as e:
    print("vsock", errno.errorcode[e.errno])
"""


def join_fresh_session_keyring() -> None:
    """Give this thread an empty anonymous session keyring (the test's keys stay in it)."""
    if _LIBC.syscall(ctypes.c_long(nr("keyctl")), ctypes.c_long(1), ctypes.c_long(0)) < 0:
        raise OSError(ctypes.get_errno(), "KEYCTL_JOIN_SESSION_KEYRING")


def add_session_key(description: str, payload: bytes) -> int:
    """Add a `user` key to this thread's session keyring; its id."""
    key = _LIBC.syscall(ctypes.c_long(nr("add_key")), ctypes.c_char_p(b"user"),
                        ctypes.c_char_p(description.encode()), ctypes.c_char_p(payload),
                        ctypes.c_size_t(len(payload)), ctypes.c_long(-3))
    if key < 0:
        raise OSError(ctypes.get_errno(), "add_key")
    return int(key)


def session_key_payloads() -> list[bytes]:
    """The payloads of the `user` keys in this thread's session keyring."""
    keyctl = ctypes.c_long(nr("keyctl"))
    ids = (ctypes.c_int32 * 64)()
    n = _LIBC.syscall(keyctl, ctypes.c_long(11), ctypes.c_long(-3), ids, ctypes.c_long(256))
    out = []
    for key in ids[:max(0, min(int(n), 256) // 4)]:
        buf = ctypes.create_string_buffer(256)
        size = _LIBC.syscall(keyctl, ctypes.c_long(11), ctypes.c_long(key), buf,
                             ctypes.c_long(256))
        if size > 0:
            out.append(buf.raw[:size])
    return out


def invalidate_key(key: int) -> None:
    _LIBC.syscall(ctypes.c_long(nr("keyctl")), ctypes.c_long(21), ctypes.c_long(key))


def pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def limits_of(pid: int) -> dict[str, tuple[str, str]]:
    """/proc/PID/limits as {name: (soft, hard)}."""
    out = {}
    with open(f"/proc/{pid}/limits") as f:
        for line in f.readlines()[1:]:
            name, soft, hard = line[:26].strip(), line[26:47].strip(), line[47:68].strip()
            out[name] = (soft, hard)
    return out


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rpartition(b")")[2].split()[1])


def cmdline_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


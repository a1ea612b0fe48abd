"""Work dirs: a private work root, and a cleanup no work dir can break or mislead.

The hostile corpus is what a sandbox can leave behind: a tree deeper than Python's
recursion limit, thousands of inodes, a sparse file at the size limit, FIFOs,
sockets, links to host directories, hard links, and files and directories with no
permissions at all. `close()` must remove all of it without raising, a symlink
swapped in during the cleanup must never be followed, and a work dir left by a
dead process must not stop the next backend from starting.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sandbox_probes as probes
from sandbox_helpers import SMALL, require_bwrap, run, workdirs

from treadle.errors import SandboxUnavailable
from treadle.sandbox import BwrapBackend, Limits
from treadle.sandbox._workdir import (
    WORKDIR_PREFIX,
    default_work_root,
    ensure_work_root,
    remove_workdir,
    sweep_stale_workdirs,
)

SRC = Path(__file__).resolve().parents[2] / "src"
DEPTH = 1_200  # past sys.getrecursionlimit() (1,000) and past PATH_MAX (4,096) as a path

# Run inside a sandbox (cwd = the work dir): every kind of thing a cleanup trips over.
CORPUS = f"""
import os, socket
os.mkdir("deep"); os.chdir("deep")
for _ in range({DEPTH}):
    os.mkdir("d"); os.chdir("d")
open("bottom", "w").close()
os.chdir(os.environ["HOME"])
os.mkdir("many")
for i in range(3000):
    open(f"many/{{i}}", "w").close()
with open("sparse", "wb") as f:
    f.truncate({SMALL.max_file_mb} * 1024 * 1024)
os.link("sparse", "hardlink")
os.mkfifo("fifo")
socket.socket(socket.AF_UNIX).bind("sock")
os.symlink("/etc", "etc-link"); os.symlink("/", "root-link"); os.symlink("deep", "loop-link")
os.mkdir("locked"); os.mkdir("locked/sub"); open("locked/sub/f", "w").close()
os.chmod("locked/sub", 0); os.chmod("locked", 0)
os.mkdir("readonly"); open("readonly/f", "w").close(); os.chmod("readonly", 0o500)
open("noperm", "w").close(); os.chmod("noperm", 0)
os.mkdir("sticky"); os.chmod("sticky", 0o1777)
os.chmod("deep", 0o500)
print("planted")
"""


def plant_tree(top: str, depth: int = DEPTH) -> None:
    """The corpus's shape built from the host (for dirs no sandbox made)."""
    os.makedirs(os.path.join(top, "many"))
    for i in range(500):
        Path(top, "many", str(i)).touch()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    os.mkfifo(os.path.join(top, "fifo"))
    os.symlink("/etc", os.path.join(top, "etc-link"))
    os.makedirs(os.path.join(top, "locked", "sub"))
    os.chmod(os.path.join(top, "locked", "sub"), 0)
    os.chmod(os.path.join(top, "locked"), 0)


def snapshot(path: str) -> tuple[int, list[str]]:
    return stat.S_IMODE(os.stat(path).st_mode), sorted(os.listdir(path))


@pytest.mark.integration
@pytest.mark.parametrize("bounded", [True, False], ids=["tmpfs", "plain"])
def test_close_removes_a_hostile_work_dir(work_root: str, bounded: bool) -> None:
    require_bwrap()
    backend = BwrapBackend(work_root=work_root, bounded_workdirs=bounded)
    etc_before = snapshot("/etc")

    async def body() -> str:
        # CPU to spare: planting 4,000 entries is kernel time, and a loaded machine's
        # kernel is slower at it; what is tested is the removal.
        sb = await backend.start(dataclasses.replace(SMALL, cpu_s=20))
        result = await sb.exec(["python3", "-c", CORPUS], timeout_s=60)
        assert result.stdout == "planted\n", result
        assert sb.workdir_bounded is (bounded and os.geteuid() == 0)  # type: ignore[attr-defined]
        await sb.close()
        await sb.close()  # idempotent, and still nothing raised
        return sb.host_dir  # type: ignore[attr-defined]

    host_dir = run(body())
    assert not os.path.lexists(host_dir)
    assert snapshot("/etc") == etc_before


def test_a_symlink_swapped_in_during_removal_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o750)
    (victim / "keep").write_text("host data")
    victim_before = snapshot(str(victim))
    work = tmp_path / "work"
    work.mkdir()
    names = [f"a{i}" for i in range(300)]
    for name in names:
        (work / name).mkdir()
        (work / name / "f").touch()
        (work / name / "sub").mkdir()
    stop = threading.Event()
    swaps = 0

    def swap() -> None:  # what a process surviving into the cleanup would do
        nonlocal swaps
        while not stop.is_set():
            for name in names:
                try:
                    os.rename(work / name, work / f"{name}.old")
                    os.symlink(victim, work / name)
                    swaps += 1
                except OSError:
                    continue

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        first = remove_workdir(str(work))  # may lose the race to new entries: never raises
    finally:
        stop.set()
        swapper.join()
    assert snapshot(str(victim)) == victim_before
    assert (victim / "keep").read_text() == "host data"
    assert first or remove_workdir(str(work))
    assert not work.exists()
    assert swaps > 0


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory uid 65534 can reach (pytest's own tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="treadle-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_removal_without_root_opens_what_the_sandbox_locked(shared_tmp: Path) -> None:
    """A non-root owner must chmod its way in, through fds, never through a link."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(python, os.X_OK):
        pytest.skip("needs root to run the removal as another uid, and a system python3")
    tmp_path = shared_tmp
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    work = tmp_path / "work"
    work.mkdir()
    plant_tree(str(work), depth=50)
    os.symlink(victim, work / "victim-link")
    (work / "readonly").mkdir()
    (work / "readonly" / "f").touch()
    for path in (tmp_path, victim, *work.rglob("*"), work):
        os.chown(path, 65534, 65534, follow_symlinks=False)
    os.chmod(work / "readonly", 0o500)
    os.chmod(work, 0o500)
    code = ("import sys; from treadle.sandbox._workdir import remove_workdir; "
            "sys.exit(0 if remove_workdir(sys.argv[1]) else 1)")
    done = subprocess.run([python, "-c", code, str(work)], env={"PYTHONPATH": str(SRC)},
                          user=65534, group=65534, extra_groups=[], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert not work.exists()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755


@pytest.mark.integration
def test_close_never_raises_and_the_next_start_retries(work_root: str) -> None:
    require_bwrap()
    if os.geteuid() != 0:
        pytest.skip("making a file immutable needs root")
    backend = BwrapBackend(work_root=work_root, bounded_workdirs=False)

    async def body() -> str:
        sb = await backend.start(SMALL)
        await sb.put_file("pinned", b"x")
        host_dir: str = sb.host_dir  # type: ignore[attr-defined]
        set_immutable(os.path.join(host_dir, "pinned"), True)  # unlink now fails with EPERM
        await sb.close()
        return host_dir

    host_dir = run(body())
    assert os.path.isdir(host_dir)  # left behind, logged, remembered
    set_immutable(os.path.join(host_dir, "pinned"), False)
    assert sweep_stale_workdirs(work_root) == 1  # this process's own failure is retried
    assert not os.path.lexists(host_dir)


def set_immutable(path: str, on: bool) -> None:
    fs_ioc_setflags, fs_immutable_fl = 0x40086602, 0x10
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, fs_ioc_setflags, struct.pack("l", fs_immutable_fl if on else 0))
    finally:
        os.close(fd)


@pytest.mark.integration
def test_the_next_start_sweeps_a_dead_owners_hostile_work_dir(work_root: str) -> None:
    require_bwrap()
    stale = os.path.join(work_root, f"{WORKDIR_PREFIX}{probes.pid_max() + 1}-planted")
    os.mkdir(stale)
    plant_tree(stale)
    mounted = os.path.join(work_root, f"{WORKDIR_PREFIX}{probes.pid_max() + 1}-mounted")
    os.mkdir(mounted)
    is_mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "treadle-work", mounted],
        check=False).returncode == 0
    if is_mounted:
        Path(mounted, "inside").write_text("x")

    async def body() -> None:
        async with await BwrapBackend(work_root=work_root).start(Limits()) as sb:
            assert (await sb.exec(["true"], timeout_s=5)).ok

    run(body())
    assert workdirs(work_root) == []


@pytest.fixture
def private_root(tmp_path: Path) -> Iterator[Path]:
    tmp_path.chmod(0o755)
    yield tmp_path / "root"


def test_a_work_root_others_could_plant_in_is_refused(private_root: Path, tmp_path: Path) -> None:
    ensure_work_root(str(private_root), traversable=True)
    assert stat.S_IMODE(private_root.stat().st_mode) == 0o711
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    link = tmp_path / "link"
    link.symlink_to(private_root)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    under_open = tmp_path / "shared" / "root"
    under_open.parent.mkdir()
    under_open.parent.chmod(0o777)  # world-writable, not sticky: anyone could swap `root`
    for bad, why in ((foreign, "owned by uid 65534"), (link, "symlink"),
                     (open_to_all, "writable by group or others"),
                     (under_open, "could be changed by another user")):
        with pytest.raises(SandboxUnavailable, match=why):
            ensure_work_root(str(bad), traversable=True)


@pytest.mark.integration
def test_a_backend_refuses_a_foreign_work_root(tmp_path: Path) -> None:
    require_bwrap()
    tmp_path.chmod(0o755)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o711)
    os.chown(foreign, 65534, 65534)

    async def body() -> None:
        await BwrapBackend(work_root=str(foreign)).start(Limits())

    with pytest.raises(SandboxUnavailable, match="refusing the sandbox work root"):
        run(body())


def test_the_default_work_root_is_private() -> None:
    root = default_work_root()
    if os.geteuid() == 0:
        assert root == "/var/lib/treadle/sandboxes"
    else:
        assert root == os.path.join(tempfile.gettempdir(), f"treadle-sandboxes-{os.getuid()}")

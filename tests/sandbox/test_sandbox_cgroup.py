"""The cgroup setup's path logic, v2 above all, on a fake cgroup file system.

This host's memory controller is on a v1 hierarchy, so the real OOM-kill tests
(test_sandbox_bwrap_security.py) run the v1 path here; on a host with only the
unified hierarchy the same tests run the v2 path. What can be checked without a v2
memory controller is checked here: `FakeCgroup2` is a directory tree that behaves
as the kernel's cgroup2 files do for what treadle writes (a group's controllers are
those its parent enables, and their interface files appear with them; a group
holding processes can neither enable controllers for its children nor, with
controllers enabled, take a process: EBUSY; writing a pid to cgroup.procs moves it
out of its old group), standing in for `_cgroup`'s two writes to the kernel
(`_make_group`, `_write`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from treadle.sandbox import Limits, _cgroup
from treadle.sandbox._cgroup import (
    GROUP_DIR,
    SERVICE_LEAF,
    CgroupV1,
    CgroupV2,
    probe_cgroups,
)
from treadle.sandbox.base import MIB

_FILES = {"memory": {"memory.max": "max", "memory.swap.max": "max",
                     "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"},
          "pids": {"pids.max": "max"}}


class FakeCgroup2:
    """A cgroup2 mount at `root` (a test double of the kernel's files; see above)."""

    def __init__(self, root: Path, controllers: str = "cpu io memory pids") -> None:
        self.root = root
        root.mkdir()
        (root / "cgroup.controllers").write_text(controllers)
        (root / "cgroup.subtree_control").write_text(controllers)
        (root / "cgroup.procs").write_text("")

    def group(self, rel: str, *procs: int) -> Path:
        """Make group `rel` holding `procs`, and its parents passing on what they have
        (as a slice does)."""
        path = self.root
        for part in rel.split("/"):
            if path != self.root:
                offered = (path / "cgroup.controllers").read_text()
                (path / "cgroup.subtree_control").write_text(offered)
            path = path / part
            if not path.exists():
                self.make_group(str(path))
        for pid in procs:
            self.write(str(path / "cgroup.procs"), str(pid))
        return path

    def make_group(self, path: str, exist_ok: bool = False) -> None:
        group = Path(path)
        if group.exists():
            if exist_ok:
                return
            raise FileExistsError(errno.EEXIST, "exists", path)
        group.mkdir()
        (group / "cgroup.procs").write_text("")
        if self.root not in group.parents:  # a v1 hierarchy's group: procs only
            return
        enabled = (group.parent / "cgroup.subtree_control").read_text().split()
        (group / "cgroup.controllers").write_text(" ".join(enabled))
        (group / "cgroup.subtree_control").write_text("")
        for controller in enabled:
            for name, value in _FILES.get(controller, {}).items():
                (group / name).write_text(value)

    def write(self, path: str, text: str) -> None:
        file = Path(path)
        group = file.parent
        if file.name == "cgroup.subtree_control":
            if group != self.root and self.procs(group):
                raise OSError(errno.EBUSY, "Device or resource busy", path)
            offered = (group / "cgroup.controllers").read_text().split()
            enabled = file.read_text().split()
            for word in text.split():
                if word[1:] not in offered:
                    raise OSError(errno.ENOENT, "No such file or directory", path)
                enabled.append(word[1:])
            file.write_text(" ".join(dict.fromkeys(enabled)))
            for child in (c for c in group.iterdir() if c.is_dir()):  # they get them now
                (child / "cgroup.controllers").write_text(file.read_text())
                for controller in file.read_text().split():
                    for name, value in _FILES.get(controller, {}).items():
                        if not (child / name).exists():
                            (child / name).write_text(value)
        elif file.name == "cgroup.procs":
            if group != self.root and (group / "cgroup.subtree_control").read_text().split():
                raise OSError(errno.EBUSY, "Device or resource busy", path)
            for other in self.root.rglob("cgroup.procs"):
                kept = [p for p in self.procs(other.parent) if p != int(text)]
                other.write_text("".join(f"{p}\n" for p in kept))
            file.write_text(file.read_text() + f"{int(text)}\n")
        elif file.exists():
            file.write_text(text)
        else:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    @staticmethod
    def procs(group: Path) -> list[int]:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCgroup2:
    kernel = FakeCgroup2(tmp_path / "cgroup")
    monkeypatch.setattr(_cgroup, "_make_group", kernel.make_group)
    monkeypatch.setattr(_cgroup, "_write", kernel.write)
    return kernel


def proc_files(tmp_path: Path, cgroup: str, mounts: list[str]) -> tuple[str, str]:
    """A /proc/self/cgroup and a mountinfo with these lines."""
    (tmp_path / "cgroup.txt").write_text(cgroup)
    (tmp_path / "mountinfo.txt").write_text("".join(f"{i + 30} 20 0:{i + 40} {line}\n"
                                                    for i, line in enumerate(mounts)))
    return str(tmp_path / "cgroup.txt"), str(tmp_path / "mountinfo.txt")


def v2_mount(fake: FakeCgroup2) -> str:
    return f"/ {fake.root} rw,nosuid - cgroup2 cgroup2 rw"


def test_v2_a_lone_service_moves_into_its_leaf_and_execs_get_memory_max(
        fake: FakeCgroup2, tmp_path: Path) -> None:
    me = os.getpid()
    service = fake.group("system.slice/treadle.service", me)
    found = probe_cgroups(*proc_files(tmp_path, "0::/system.slice/treadle.service\n",
                                      [v2_mount(fake)]))
    assert isinstance(found, CgroupV2) and found.controllers == ("memory", "pids")
    base = service / GROUP_DIR
    assert found.bases == {"memory": str(base), "pids": str(base)}
    # It left its group for a leaf, so that the group could pass memory and pids on.
    assert fake.procs(service) == [] and fake.procs(service / SERVICE_LEAF) == [me]
    assert (service / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]
    assert (base / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]

    group = found.create(Limits(memory_mb=96, max_processes=7))
    (path,) = group.groups()
    assert Path(path).parent == base and group.dirs == {"memory": path, "pids": path}
    assert Path(path, "memory.max").read_text() == str(96 * MIB)
    assert Path(path, "memory.swap.max").read_text() == "0"  # no paging out past it
    assert Path(path, "pids.max").read_text() == "7"
    group.attach(4242)
    assert fake.procs(Path(path)) == [4242]
    assert (group.oom_kills(), group.oom_killed()) == (0, False)
    Path(path, "memory.events").write_text("low 0\nhigh 3\nmax 9\noom 2\noom_kill 2\n")
    assert (group.oom_kills(), group.oom_killed()) == (2, True)


def test_v2_without_swap_accounting_still_limits_memory(fake: FakeCgroup2,
                                                        tmp_path: Path) -> None:
    fake.group("svc", os.getpid())
    found = probe_cgroups(*proc_files(tmp_path, "0::/svc\n", [v2_mount(fake)]))
    assert found is not None
    _FILES["memory"].pop("memory.swap.max")
    try:
        group = found.create(Limits(memory_mb=64))
    finally:
        _FILES["memory"]["memory.swap.max"] = "max"
    (path,) = group.groups()
    assert Path(path, "memory.max").read_text() == str(64 * MIB)
    assert not Path(path, "memory.swap.max").exists() and "memory" in group.dirs


def test_v2_a_group_holding_other_processes_is_left_as_it_is(fake: FakeCgroup2,
                                                             tmp_path: Path) -> None:
    shared = fake.group("user.slice/session-1.scope", 1, os.getpid())
    found = probe_cgroups(*proc_files(tmp_path, "0::/user.slice/session-1.scope\n",
                                      [v2_mount(fake)]))
    assert found is None
    assert fake.procs(shared) == [1, os.getpid()]  # nobody was moved
    assert not (shared / SERVICE_LEAF).exists() and not (shared / GROUP_DIR).exists()
    assert (shared / "cgroup.subtree_control").read_text() == ""


def test_v2_a_process_started_in_the_leaf_shares_the_layout(fake: FakeCgroup2,
                                                            tmp_path: Path) -> None:
    service = fake.group("svc", os.getpid())
    assert probe_cgroups(*proc_files(tmp_path, "0::/svc\n", [v2_mount(fake)])) is not None
    # A sandbox server the service started: in the leaf, beside the service.
    fake.write(str(service / SERVICE_LEAF / "cgroup.procs"), "777")
    child = probe_cgroups(*proc_files(tmp_path, f"0::/svc/{SERVICE_LEAF}\n",
                                      [v2_mount(fake)]))
    assert isinstance(child, CgroupV2)
    assert set(child.bases.values()) == {str(service / GROUP_DIR)}
    assert sorted(fake.procs(service / SERVICE_LEAF)) == sorted([os.getpid(), 777])


def test_v2_without_the_memory_controller_offered_is_not_used(fake: FakeCgroup2,
                                                              tmp_path: Path) -> None:
    (fake.root / "cgroup.subtree_control").write_text("cpu io")
    fake.group("svc", os.getpid())
    assert probe_cgroups(*proc_files(tmp_path, "0::/svc\n", [v2_mount(fake)])) is None


def test_v1_is_used_where_it_has_memory_else_v2(fake: FakeCgroup2, tmp_path: Path) -> None:
    memory = tmp_path / "v1-memory"
    (memory / "box").mkdir(parents=True)
    fake.group("svc", os.getpid())
    v1_memory = f"/ {memory} rw - cgroup cgroup rw,memory"
    hybrid = probe_cgroups(*proc_files(tmp_path, "4:memory:/box\n0::/svc\n",
                                       [v1_memory, v2_mount(fake)]))
    assert isinstance(hybrid, CgroupV1)
    assert hybrid.bases == {"memory": str(memory / "box" / GROUP_DIR)}
    assert fake.procs(fake.root / "svc") == [os.getpid()]  # v2 untouched
    # Without a v1 memory hierarchy, the unified one.
    unified = probe_cgroups(*proc_files(tmp_path, "0::/svc\n", [v2_mount(fake)]))
    assert isinstance(unified, CgroupV2)

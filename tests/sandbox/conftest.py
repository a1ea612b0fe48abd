"""Fixtures: a private work root per test, and the backends built on it; images.

Real-bwrap tests fail (not skip) when bwrap is missing, because CI must run them;
set TREADLE_ALLOW_NO_BWRAP=1 to skip them on a machine without it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sandbox_images
from sandbox_helpers import descendants, require_bwrap, run, workdirs

from treadle.errors import SandboxUnavailable
from treadle.sandbox import BwrapBackend, Limits, LocalBackend, _workdir
from treadle.sandbox.images import ImageCache


@pytest.fixture
def work_root() -> Iterator[str]:
    """A fresh work root; the test fails if a work dir or a child process is left behind."""
    root = tempfile.mkdtemp(prefix="treadle-test-root-", dir="/tmp")
    os.chmod(root, 0o711)  # the sandbox uid must be able to traverse it
    children_before = set(descendants())
    yield root
    leaked_dirs = workdirs(root)
    leaked_procs = set(descendants()) - children_before
    shutil.rmtree(root, ignore_errors=True)
    assert not leaked_dirs, f"work dirs left behind: {leaked_dirs}"
    assert not leaked_procs, f"child processes left behind: {leaked_procs}"


@pytest.fixture
def bwrap(work_root: str) -> BwrapBackend:
    require_bwrap()
    backend = BwrapBackend(work_root=work_root)

    async def probe() -> None:
        async with await backend.start(Limits()):
            pass

    try:
        run(probe())
    except SandboxUnavailable as e:
        pytest.fail(f"bwrap is installed but cannot run sandboxes here: {e}", pytrace=False)
    return backend


@pytest.fixture
def local(work_root: str) -> LocalBackend:
    return LocalBackend(work_root=work_root)


@pytest.fixture(scope="session")
def debian_rootfs() -> Path:
    """A Debian root file system (mmdebstrap; built once per machine, then cached)."""
    rootfs, _ = sandbox_images.debian_rootfs()
    return rootfs


@pytest.fixture(scope="session")
def image_cache() -> Iterator[ImageCache]:
    """One image cache for the session (every image unpacked once), removed at the end."""
    root = tempfile.mkdtemp(prefix="treadle-test-images-", dir="/tmp")
    os.chmod(root, 0o711)
    yield ImageCache(os.path.join(root, "cache"))
    _workdir.remove_workdir(root)


@pytest.fixture
def image_bwrap(work_root: str, debian_rootfs: Path, image_cache: ImageCache) -> BwrapBackend:
    """A bwrap backend whose sandboxes run on the Debian root file system."""
    require_bwrap()
    return BwrapBackend(work_root=work_root, image=str(debian_rootfs), image_cache=image_cache)

"""Fixtures for the envs tests: one sandbox backend for the session, on a private root.

Integration tests run through bwrap, and fail (not skip, never fall back to the local
backend) where bwrap is missing or cannot run, as tests/sandbox's do: a test named
for a sandbox must have run in one. Set TREADLE_ALLOW_NO_BWRAP=1 to skip them on a
machine without it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from envs_helpers import Backend, pick_backend


@pytest.fixture(scope="session")
def sandbox_backend() -> Iterator[Backend]:
    root = tempfile.mkdtemp(prefix="treadle-envs-test-", dir="/tmp")
    os.chmod(root, 0o711)  # the sandbox uid must be able to traverse it
    chosen = pick_backend(root)
    yield chosen
    leaked = sorted(n for n in os.listdir(root) if n.startswith("treadle-sb-"))
    shutil.rmtree(root, ignore_errors=True)
    assert not leaked, f"sandbox work dirs left behind: {leaked}"

"""The security battery again, inside sandboxes on an image (the Debian root file system).

The tests are test_sandbox_bwrap_security.py's own, collected here a second time
with its `bwrap` fixture replaced by a backend on the image: an image changes what
`/` shows, not the namespaces, filter or limits, and these attacks must fare the
same. Left out: the ones about the host's own system view (which an image
replaces: test_image_shows_nothing_of_the_host below instead) and those that build
their own backend.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from test_sandbox_bwrap_security import (  # noqa: F401  (collected again, on the image)
    listener,
    sh,
    test_cpu_spin_is_killed_by_the_cpu_limit,
    test_file_api_refuses_escapes_planted_from_inside,
    test_fork_bomb_respects_the_process_limit,
    test_host_files_are_unreadable,
    test_host_loopback_is_unreachable,
    test_host_processes_are_invisible,
    test_memory_bomb_is_oom_killed_by_the_cgroup,
    test_no_network_interfaces_dns_or_egress,
    test_no_process_can_be_traced_or_written_into,
    test_nothing_survives_the_exec_or_close,
    test_parent_environment_is_invisible,
    test_pid1_and_the_whole_tree_hold_the_limits,
    test_system_calls_no_tool_needs_are_refused,
    test_writes_outside_the_work_dir_fail_and_host_is_unchanged,
)

from treadle.sandbox import BwrapBackend

pytestmark = pytest.mark.integration


@pytest.fixture
def bwrap(image_bwrap: BwrapBackend) -> BwrapBackend:
    """The battery's backend: sandboxes on the Debian image."""
    return image_bwrap


def test_image_shows_nothing_of_the_host(bwrap: BwrapBackend, debian_rootfs: Path) -> None:
    marker = f"treadle-host-only-{secrets.token_hex(4)}"
    planted = Path("/usr/local/share") / marker  # a system dir the host view would show
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text("host\n")
    try:
        top = sh(bwrap, "ls -A /")
        share = sh(bwrap, f"ls -A /usr/local/share; cat /usr/local/share/{marker}")
    finally:
        planted.unlink()
    assert set(top.stdout.split()) == {p.name for p in debian_rootfs.iterdir()} | {"work"}
    image_share = debian_rootfs / "usr" / "local" / "share"
    assert share.stdout.split() == sorted(p.name for p in image_share.iterdir()), share
    assert marker not in share.stdout and share.exit_code != 0, share

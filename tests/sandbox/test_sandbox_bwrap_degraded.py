"""The bwrap battery again, on a host that offers no cgroups.

Every attack of test_sandbox_bwrap_security.py that does not need a cgroup is
imported here unchanged and played against a backend that uses none
(`use_cgroups=False`, and plain work dirs): the rlimits must then hold
for the whole tree on their own (bwrap's pid 1 included), nothing may survive an
exec or `close()` without a cgroup to kill it, and the system-call filter and
the covers over /proc/1 and the kernel keys must not depend on either.
"""

from __future__ import annotations

import pytest
from sandbox_helpers import require_bwrap, run
from test_sandbox_bwrap_security import (  # noqa: F401  (collected here: run degraded)
    test_big_files_are_capped,
    test_cpu_spin_is_killed_by_the_cpu_limit,
    test_dev_shm_is_sized_like_tmp_and_dev_is_read_only,
    test_file_api_refuses_escapes_planted_from_inside,
    test_fork_bomb_is_contained,
    test_fork_bomb_respects_the_process_limit,
    test_host_processes_are_invisible,
    test_killing_the_parent_or_everything_does_not_reach_the_host,
    test_memory_bomb_fails_its_allocation,
    test_no_process_can_be_traced_or_written_into,
    test_nothing_survives_the_exec_or_close,
    test_one_sandbox_cannot_leave_keys_for_another,
    test_pid1_and_the_whole_tree_hold_the_limits,
    test_system_calls_no_tool_needs_are_refused,
    test_the_callers_session_keyring_is_out_of_reach,
    test_writes_outside_the_work_dir_fail_and_host_is_unchanged,
)

from treadle.sandbox import BwrapBackend, Limits

pytestmark = pytest.mark.integration


@pytest.fixture
def bwrap(work_root: str) -> BwrapBackend:
    """Overrides conftest's `bwrap` for the imported battery: no cgroups, plain work dirs."""
    require_bwrap()
    backend = BwrapBackend(work_root=work_root, use_cgroups=False, bounded_workdirs=False)

    async def probe() -> None:
        async with await backend.start(Limits()) as sb:
            assert not sb.workdir_bounded  # type: ignore[attr-defined]

    run(probe())
    assert backend.cgroup_controllers == ()
    return backend

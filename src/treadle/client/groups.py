"""GRPO groups out of a job's stream, each handed out as soon as it is whole.

Trajectories finish in completion order, which mixes groups; a trainer computing
group-relative advantages needs a whole group, and it should not wait for the
batch's slowest group to start on the others. `GroupCollector` keeps the members
seen so far and returns a `Group` the moment its last member is added.

A group's size comes from the job (`treadle.client.wire.group_sizes`: a suite job's
`samples_per_task`, a workload's `group_size`, a trace's lines per group). The
service delivers every planned trajectory — cancelled ones as aborted, lost ones as
errors — so every group completes; groups still short when a stream ends (a
stream read with ``follow=False``, or a wrong size) are what `rest` returns,
flagged ``complete=False``.

Infrastructure failures are flagged, never scored: `Group.excluded` names the
members that must not train (status error or aborted, with the reason the
converters give, `treadle.client.samples.exclusion_reason`), and `Group.batch`
hands the group to `training_sequences`, which drops them and computes the
advantages over the members that ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from treadle.client.errors import GroupError
from treadle.client.samples import Batch, exclusion_reason, training_sequences
from treadle.client.wire import Delivered, GroupSizes
from treadle.types import Trajectory


@dataclass(frozen=True, slots=True)
class Group:
    """The delivered members of one GRPO group."""

    group_id: str  # the wire group id (``{job_id}/{task or group}``)
    size: int  # members the job planned for it
    members: tuple[Delivered, ...]  # by repetition
    # A continuous job's group (`take`): a member's oldest token was out of the job's
    # max_staleness (on_stale "flag"); its take number.
    stale: bool = False
    taken: int | None = None

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size

    @property
    def trajectories(self) -> list[Trajectory]:
        return [d.trajectory for d in self.members]

    @property
    def excluded(self) -> dict[str, str]:
        """Trajectory id -> why it must not train (infrastructure failure or aborted)."""
        out = {}
        for d in self.members:
            reason = exclusion_reason(d.trajectory)
            if reason is not None:
                out[d.trajectory.trajectory_id] = reason
        return out

    @property
    def infra_failures(self) -> list[str]:
        """Ids of the members with status error: excluded, never a reward of 0."""
        return [d.trajectory.trajectory_id for d in self.members if d.trajectory.infra_failure]

    @property
    def trainable(self) -> list[Trajectory]:
        """The members that train (everything but errors and aborts)."""
        excluded = self.excluded
        return [t for t in self.trajectories if t.trajectory_id not in excluded]

    def batch(self, *, drop_group_on_failure: bool = False, normalize_std: bool = True,
              epsilon: float = 1e-6) -> Batch:
        """The group's training sequences and GRPO advantages (`training_sequences`,
        excluded members dropped). ConversionError for members without tokens (a
        replayed workload has none)."""
        return training_sequences(self.trajectories, drop_failed=True,
                                  drop_group_on_failure=drop_group_on_failure,
                                  normalize_std=normalize_std, epsilon=epsilon)


class GroupCollector:
    """Members per group until each is whole; see the module docstring."""

    def __init__(self, sizes: GroupSizes) -> None:
        if isinstance(sizes, int):
            if sizes < 1:
                raise ValueError(f"group size must be >= 1, got {sizes}")
        elif any(n < 1 for n in sizes.values()):
            raise ValueError("every group size must be >= 1")
        self.sizes = sizes
        self._open: dict[str, list[Delivered]] = {}  # in order of first delivery
        self._done: set[str] = set()

    def size_of(self, group_id: str) -> int:
        if isinstance(self.sizes, int):
            return self.sizes
        if group_id not in self.sizes:
            raise GroupError(f"group {group_id!r} is not among the job's "
                             f"{len(self.sizes)} declared groups")
        return self.sizes[group_id]

    def add(self, delivered: Delivered) -> Group | None:
        """Add one delivered trajectory; its group if that made it whole."""
        gid = delivered.trajectory.key.group_id
        size = self.size_of(gid)
        if gid in self._done:
            raise GroupError(f"group {gid!r} has more than {size} members "
                             f"(another: {delivered.trajectory.trajectory_id!r})")
        members = self._open.setdefault(gid, [])
        members.append(delivered)
        if len(members) < size:
            return None
        del self._open[gid]
        self._done.add(gid)
        return _group(gid, size, members)

    def rest(self) -> list[Group]:
        """Groups not yet whole, in order of their first delivery (incomplete)."""
        return [_group(g, self.size_of(g), m) for g, m in self._open.items()]


def _group(gid: str, size: int, members: list[Delivered]) -> Group:
    ordered = sorted(members, key=lambda d: (d.trajectory.key.repetition, d.seq))
    return Group(gid, size, tuple(ordered))


__all__ = ["Group", "GroupCollector", "GroupSizes"]

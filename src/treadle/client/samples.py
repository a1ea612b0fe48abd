"""From trajectories to training sequences: who is excluded, what each row carries.

This is the policy every converter (verl, SkyRL, TRL) applies; the converters only
change the field names and the containers.

**Excluded trajectories.** A trajectory with status ERROR (an infrastructure failure:
`Trajectory.infra_failure`) or ABORTED (cancelled by the caller) says nothing about
the policy, so it is never training data and never gets a reward: not 0, not
anything. A converter either drops it (``drop_failed=True``, the default) or, where
the trainer's format is positional and cannot lose a row, keeps it as a masked row
(loss mask all 0, reward None) flagged as excluded; where neither is possible
(SkyRL without step-wise training) it raises ConversionError. `Batch.exclusions`
and `Converted.exclusions` list what was left out, with the reason.

**Its group.** By default the rest of the group is kept (``drop_group_on_failure=
False``): infrastructure failures are rare and mostly unrelated to what the model
wrote, and dropping the group would throw away n - 1 good samples; the group's
baseline is then the mean over the members that ran. When failures may correlate
with the outcome (a sandbox that dies on the longest, hardest runs), the remaining
members are a biased sample of the group: ``drop_group_on_failure=True`` excludes
the whole group, at the price of its good samples.

**Frozen sub-agents.** A trajectory with ``trainable`` false (a sub-agent whose
tokens must not be trained; its record has loss mask 0 throughout) is excluded like
an aborted one, whatever its status, with the reason ``frozen sub-agent (of
<parent_id>)`` (``frozen`` when it has no parent): it needs no reward, it never
enters its group's baseline, and a converter drops it or keeps it masked as it does
an aborted one. It is no failure: ``drop_group_on_failure`` never drops its group
because of it. Sub-agent trajectories normally come in groups of their own (the
parent's siblings are in the parent's group, its sub-agents are not), so a frozen
sub-agent's group is usually all frozen and wholly excluded; a trainable sub-agent
trains in its group like any other trajectory.

**Unjudged trajectories.** A trajectory its rubric's judges gave no verdict on a
required dimension (`Trajectory.flagged`: the judge failed, timed out or answered
unreadably within its retries) has no reward, and is excluded like an aborted one,
with the reason ``unjudged: <dimension>: <why>``; a judge failure is no score of 0.
A dimension the rubric marks optional does not flag it: it trains on the others.

**Everything else is trained**, including TRUNCATED, MAX_TURNS and TIMEOUT: those
are the agent's outcomes, scored by the environment. Such a trajectory must have a
reward; one that is not terminal or not scored raises ConversionError.

**Bad records are skipped, never the batch.** A trajectory with no token segments
(a simulated run, a session ended before any call) has nothing to train on: it is
left out like an excluded one (dropped, or a masked row where the format is
positional), marked `Exclusion.skipped`, logged as a warning, and counted in
`Batch.skipped` / `Converted.skipped`. Like a frozen one, it leaves its group
alone (``drop_group_on_failure`` does not drop the group for it).

**Segments.** A trajectory whose context was edited has several token segments;
each becomes one training sequence, and every segment of a trajectory carries the
trajectory's reward and its advantage. The advantage is computed once per
trajectory over its group (`treadle.client.advantages`), not once per segment, so
a trajectory with k segments does not weigh k times in its group's baseline. (A
trainer that computes GRPO over rows instead would; see docs/client.md per trainer.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from treadle.client.advantages import group_advantages
from treadle.client.errors import ConversionError
from treadle.types import Trajectory, TrajectoryStatus

_T = TypeVar("_T")
log = logging.getLogger(__name__)
NO_TOKENS = "no token segments: nothing to train on (a simulated run, or a session "\
            "ended before any call)"


@dataclass(frozen=True, slots=True)
class Exclusion:
    """A trajectory left out of training, and why."""

    trajectory_id: str  # the excluded trajectory
    group_id: str  # its GRPO group
    status: TrajectoryStatus  # its terminal status (any, when its group was dropped)
    # e.g. "infra_failure (engine): engine unreachable", "frozen sub-agent (of t1)",
    # "group member t3 excluded"
    reason: str
    # The record itself cannot train (no token segments): skipped as bad data, where
    # the others are left out by the training policy.
    skipped: bool = False


@dataclass(frozen=True, slots=True)
class TrainingSequence:
    """One training sequence: one token segment of one trajectory."""

    trajectory_id: str  # the trajectory it comes from
    group_id: str  # GRPO group
    task_id: str  # the task it samples
    repetition: int  # 0..n-1 within the group
    segment_index: int  # 0-based position among the trajectory's segments
    num_segments: int  # segments of the trajectory
    prompt_ids: list[int]  # the context before the segment's first turn
    response_ids: list[int]  # model and observation tokens
    loss_mask: list[int]  # 1 = sampled by the model; all 0 on an excluded row
    logprobs: list[float]  # engine logprobs, 0.0 where the mask is 0
    policy_versions: list[int]  # weights version per response token
    reward: float | None  # the trajectory's reward; None exactly on an excluded row
    advantage: float | None  # the trajectory's group advantage; None on an excluded row
    status: TrajectoryStatus  # the trajectory's terminal status
    excluded: str | None  # why this row must not train (None: it trains)
    # Why the segment began (`TokenSegment.start_reason`): "start" for the first, else
    # the context edit that forced a new sequence; "start" on a row without tokens.
    start_reason: str = "start"

    @property
    def is_last_segment(self) -> bool:
        return self.segment_index == self.num_segments - 1


@dataclass(frozen=True, slots=True)
class Batch:
    """Training sequences and the trajectories left out."""

    sequences: list[TrainingSequence]  # in input order, a trajectory's segments in order
    exclusions: list[Exclusion]  # in input order

    @property
    def skipped(self) -> int:
        """Bad records left out (`Exclusion.skipped`)."""
        return sum(e.skipped for e in self.exclusions)


@dataclass(frozen=True, slots=True)
class Converted(Generic[_T]):
    """A converter's output in the trainer's own shape, and what it left out."""

    data: _T  # what the trainer takes (a list of records, a dict of columns)
    exclusions: list[Exclusion]  # trajectories dropped or masked, in input order

    @property
    def skipped(self) -> int:
        """Bad records left out (`Exclusion.skipped`)."""
        return sum(e.skipped for e in self.exclusions)


def exclusion_reason(t: Trajectory) -> str | None:
    """Why `t` on its own is no training data (frozen, ERROR, ABORTED, unjudged), or
    None."""
    # Frozen first: such a trajectory is never trained whatever its status, so that is
    # the reason (an ERROR among frozen sub-agents still says so in its status).
    if not t.trainable:
        return "frozen" if t.parent_id is None else f"frozen sub-agent (of {t.parent_id})"
    if t.status is TrajectoryStatus.ERROR:
        stage = t.failure_stage.value if t.failure_stage else "unknown stage"
        return f"infra_failure ({stage}): {t.reason or 'no reason given'}"
    if t.status is TrajectoryStatus.ABORTED:
        return f"aborted: {t.reason or 'no reason given'}"
    if t.flagged:
        return "unjudged: " + "; ".join(f"{j.dimension}: {j.reason}"
                                        for j in t.judgements if j.missing)
    return None


def exclusions(trajectories: Sequence[Trajectory], *,
               drop_group_on_failure: bool = False) -> dict[str, Exclusion]:
    """Trajectory id -> Exclusion for every trajectory that must not train.

    Raises ConversionError for a trajectory that is not terminal, for one that
    would train but has no reward, and for a repeated trajectory id or (group,
    repetition). One that would train but has no token segments is skipped
    (`Exclusion.skipped`, a logged warning).
    """
    seen: set[str] = set()
    slots: set[tuple[str, int]] = set()
    out: dict[str, Exclusion] = {}
    broken: dict[str, str] = {}  # group id -> a member whose failure drops the group
    for t in trajectories:
        if t.trajectory_id in seen:
            raise ConversionError(f"trajectory {t.trajectory_id!r} appears twice")
        if (t.key.group_id, t.key.repetition) in slots:
            raise ConversionError(f"group {t.key.group_id!r} has repetition "
                                  f"{t.key.repetition} twice")
        seen.add(t.trajectory_id)
        slots.add((t.key.group_id, t.key.repetition))
        if not t.status.terminal:
            raise ConversionError(f"trajectory {t.trajectory_id!r} is {t.status.value}, "
                                  f"not finished")
        reason = exclusion_reason(t)
        if reason is not None:
            out[t.trajectory_id] = Exclusion(t.trajectory_id, t.key.group_id, t.status, reason)
            # A frozen member was never going to train: its absence does not bias the
            # survivors the way a failure may, so it leaves its group alone.
            if t.trainable:
                broken[t.key.group_id] = t.trajectory_id
        elif not t.segments:
            out[t.trajectory_id] = Exclusion(t.trajectory_id, t.key.group_id, t.status,
                                             NO_TOKENS, skipped=True)
        elif t.reward is None:
            raise ConversionError(f"trajectory {t.trajectory_id!r} ({t.status.value}) has no "
                                  f"reward: score it before training")
    skipped = [e.trajectory_id for e in out.values() if e.skipped]
    if skipped:
        log.warning("skipped %d trajectories with no token segments (nothing to train on): "
                    "%s", len(skipped), ", ".join(skipped[:10]) + (", ..." if len(skipped) > 10
                                                                  else ""))
    if drop_group_on_failure and broken:
        for t in trajectories:
            if t.trajectory_id not in out and t.key.group_id in broken:
                out[t.trajectory_id] = Exclusion(
                    t.trajectory_id, t.key.group_id, t.status,
                    f"group member {broken[t.key.group_id]} excluded")
    return out


def training_sequences(trajectories: Sequence[Trajectory], *, drop_failed: bool = True,
                       drop_group_on_failure: bool = False, normalize_std: bool = True,
                       epsilon: float = 1e-6) -> Batch:
    """One `TrainingSequence` per segment, with rewards and GRPO advantages.

    Excluded trajectories are dropped (``drop_failed=True``) or kept as masked rows
    with reward and advantage None, one row per segment (one row with empty token
    lists, segment_index 0 and num_segments 1, if they have none). Advantages are
    over the trained members of each group (`group_advantages`). A trajectory with
    no token segments is skipped (`Batch.skipped`), as a row only where excluded
    ones are kept.
    """
    out_of = exclusions(trajectories, drop_group_on_failure=drop_group_on_failure)
    trained = [t for t in trajectories if t.trajectory_id not in out_of]
    scores = group_advantages([_reward(t) for t in trained], [t.key.group_id for t in trained],
                              normalize_std=normalize_std, epsilon=epsilon)
    advantage = {t.trajectory_id: a for t, a in zip(trained, scores, strict=True)}
    sequences: list[TrainingSequence] = []
    for t in trajectories:
        exclusion = out_of.get(t.trajectory_id)
        if exclusion is not None and drop_failed:
            continue
        sequences.extend(_rows(t, advantage.get(t.trajectory_id),
                               None if exclusion is None else exclusion.reason))
    return Batch(sequences, [out_of[t.trajectory_id] for t in trajectories
                             if t.trajectory_id in out_of])


def in_group_order(trajectories: Iterable[Trajectory],
                   group_ids: Sequence[str]) -> list[Trajectory]:
    """The trajectories ordered group by group as `group_ids` lists them, by repetition
    within a group: the order of a trainer's prompt list repeated n times.

    Raises ConversionError for a trajectory of an unlisted group, a listed group
    without trajectories, or groups of unequal size.
    """
    position = {g: i for i, g in enumerate(group_ids)}
    members: list[list[Trajectory]] = [[] for _ in group_ids]
    for t in trajectories:
        if t.key.group_id not in position:
            raise ConversionError(f"trajectory {t.trajectory_id!r} is of group "
                                  f"{t.key.group_id!r}, which is not listed")
        members[position[t.key.group_id]].append(t)
    sizes = {len(m) for m in members}
    if 0 in sizes or len(sizes) > 1:
        counts = ", ".join(f"{g}: {len(m)}" for g, m in zip(group_ids, members, strict=True))
        raise ConversionError(f"groups must all have the same number of trajectories "
                              f"(at least one): {counts}")
    return [t for m in members for t in sorted(m, key=lambda t: t.key.repetition)]


def _reward(t: Trajectory) -> float:
    assert t.reward is not None  # exclusions() refused unscored trained trajectories
    return t.reward


def _rows(t: Trajectory, advantage: float | None, excluded: str | None) -> list[TrainingSequence]:
    n = len(t.segments)
    if excluded is not None and not t.segments:
        return [TrainingSequence(t.trajectory_id, t.key.group_id, t.task_id, t.key.repetition,
                                 0, 1, [], [], [], [], [], None, None, t.status, excluded)]
    return [TrainingSequence(
        trajectory_id=t.trajectory_id, group_id=t.key.group_id, task_id=t.task_id,
        repetition=t.key.repetition, segment_index=i, num_segments=n,
        prompt_ids=list(s.prompt_ids), response_ids=list(s.response_ids),
        loss_mask=list(s.loss_mask) if excluded is None else [0] * len(s.response_ids),
        logprobs=list(s.logprobs) if excluded is None else [0.0] * len(s.response_ids),
        policy_versions=list(s.policy_versions),
        reward=None if excluded is not None else t.reward,
        advantage=None if excluded is not None else advantage,
        status=t.status, excluded=excluded, start_reason=s.start_reason)
        for i, s in enumerate(t.segments)]

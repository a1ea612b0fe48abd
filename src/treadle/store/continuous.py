"""The statements behind a continuous job's calls on `Store`, run inside the
transaction the call began (as `rows`).

A continuous job's plan grows a GRPO group at a time (`launch`): a `job_groups` row
and one trajectory per member. A member that finishes counts towards its group
(`member_finished`); a group whose current members have all finished is *ready*,
numbered in the order that happened. `take` hands ready groups out oldest-ready
first, each once: it gives a group the job's next take number, dense from 1, and
the id of the take call (the caller's); the same call asked again gets the same
groups back — a trainer whose answer was lost repeats the call and receives what
it missed — and any other call gets other groups: none is handed out twice. A
member restarted as stale (`restart`) is superseded by a new trajectory of its
group (same group and repetition, a new id); the old one keeps its row and its
delivery on the job's trajectory stream, and its tokens are counted as discarded.

The staleness bound at hand-out: `take` is given the oldest policy version still
fresh (`min_fresh`, the served version minus the job's `max_staleness`). A group
with a member whose oldest sampled token is older is, by the job's `StaleChoice`,
handed out flagged (`FLAG`), left for the service to restart (`RESTART`), or handed
out with that member's old tokens cut (`CUT`, `staleness.cut_record`; a member that
cannot be cut is left for a restart like `RESTART`). So no group is ever handed out
as fresh with a token out of the bound, whenever the service gets round to its
restarts.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from treadle.store import rows
from treadle.store.errors import NotFound, StoreConflict
from treadle.store.jobs import Delivery, PlannedTrajectory, TakenGroup
from treadle.store.record import dumps_record, trajectory_to_record
from treadle.store.staleness import cut_record
from treadle.types import GroupKey, StaleChoice, Timings, Trajectory, TrajectoryStatus

_MEMBERS = ("SELECT seq, trajectory_id, record, first_version FROM trajectories "
            "WHERE job_id = ? AND group_id = ? AND superseded = 0 ORDER BY repetition")


def launch(conn: sqlite3.Connection, job_id: str, group_id: str,
           planned: Sequence[PlannedTrajectory], close: bool, now: float) -> None:
    """Add a group and its members to an open job; `close`: the last one."""
    info = rows.job_info(conn, job_id)
    if info.status.terminal:
        raise StoreConflict(f"job {job_id!r} is {info.status.value}: no group joins it")
    pos = conn.execute("SELECT count(*) FROM job_groups WHERE job_id = ?",
                       (job_id,)).fetchone()[0]
    try:
        conn.execute("INSERT INTO job_groups (job_id, group_id, pos, size) VALUES (?, ?, ?, ?)",
                     (job_id, group_id, pos, len(planned)))
    except sqlite3.IntegrityError:
        raise StoreConflict(f"job {job_id!r}: group {group_id!r} exists") from None
    rows.add_planned(conn, job_id, planned)
    if close:
        conn.execute("UPDATE jobs SET open = 0 WHERE job_id = ?", (job_id,))
    rows.event(conn, job_id, None, "group_launched", {"group_id": group_id, "pos": pos}, now)


def close(conn: sqlite3.Connection, job_id: str, now: float) -> None:
    """No group joins the job any more: it completes once every trajectory has."""
    conn.execute("UPDATE jobs SET open = 0 WHERE job_id = ?", (job_id,))
    planned, delivered, status = conn.execute(
        "SELECT planned, delivered, status FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
    if delivered == planned and status in ("queued", "running"):
        conn.execute("UPDATE jobs SET status = 'completed', finished_at = ? WHERE job_id = ?",
                     (now, job_id))


def launched(conn: sqlite3.Connection, job_id: str) -> tuple[int, int, int]:
    """(groups launched, groups taken, groups launched and not taken)."""
    n, taken = conn.execute("SELECT count(*), count(taken) FROM job_groups WHERE job_id = ?",
                            (job_id,)).fetchone()
    return int(n), int(taken), int(n) - int(taken)



def member_finished(conn: sqlite3.Connection, job_id: str, t: Trajectory) -> None:
    """A current member of a continuous job's group finished (no row matches for
    other jobs: a key lookup). Its group is ready once all have."""
    span = t.policy_span
    conn.execute("UPDATE trajectories SET first_version = ? WHERE job_id = ? AND "
                 "trajectory_id = ?", (None if span is None else span[0], job_id,
                                       t.trajectory_id))
    conn.execute(
        "UPDATE job_groups SET done = done + 1, ready_seq = CASE WHEN done + 1 >= size THEN "
        "(SELECT coalesce(max(ready_seq), 0) + 1 FROM job_groups WHERE job_id = ?) END "
        "WHERE job_id = ? AND group_id = ? AND taken IS NULL",
        (job_id, job_id, t.key.group_id))


def take(conn: sqlite3.Connection, job_id: str, take_id: str, n: int,
         min_fresh: int | None, choice: StaleChoice) -> list[TakenGroup]:
    """The groups handed out to take call `take_id`, topped up to `n` with ready
    ones given the job's next take numbers (module docstring)."""
    out = _taken(conn, job_id, "take_id = ?", take_id, n)
    if len(out) >= n:
        return out
    total = int(conn.execute("SELECT taken FROM jobs WHERE job_id = ?",
                             (job_id,)).fetchone()[0])
    ready = conn.execute("SELECT group_id, size FROM job_groups WHERE job_id = ? AND "
                         "taken IS NULL AND ready_seq IS NOT NULL ORDER BY ready_seq",
                         (job_id,)).fetchall()
    for group_id, size in ready:
        if len(out) == n:
            break
        members = conn.execute(_MEMBERS, (job_id, group_id)).fetchall()
        versions = [v for *_, v in members if v is not None]
        stale = min_fresh is not None and bool(versions) and min(versions) < min_fresh
        if stale and choice is StaleChoice.RESTART:
            continue
        if stale and choice is StaleChoice.CUT:
            assert min_fresh is not None
            cuts = {tid: cut_record(rec, min_fresh) for _, tid, rec, v in members
                    if v is not None and v < min_fresh}
            if any(c is None for c in cuts.values()):
                continue  # nothing of it would train: the service restarts it
            conn.executemany("UPDATE trajectories SET record = ?, first_version = ? "
                             "WHERE job_id = ? AND trajectory_id = ?",
                             [(c, min_fresh, job_id, tid) for tid, c in cuts.items()])
            members = conn.execute(_MEMBERS, (job_id, group_id)).fetchall()
            stale = False
        total += 1
        conn.execute("UPDATE job_groups SET taken = ?, take_id = ?, stale = ? WHERE "
                     "job_id = ? AND group_id = ?",
                     (total, take_id, int(stale), job_id, group_id))
        out.append(TakenGroup(total, group_id, int(size), stale,
                              tuple(Delivery(int(s), tid, r) for s, tid, r, _ in members)))
    conn.execute("UPDATE jobs SET taken = ? WHERE job_id = ?", (total, job_id))
    return out


def _taken(conn: sqlite3.Connection, job_id: str, where: str, value: str | int,
           limit: int) -> list[TakenGroup]:
    found = conn.execute(f"SELECT taken, group_id, size, stale FROM job_groups WHERE "
                         f"job_id = ? AND {where} ORDER BY taken LIMIT ?",
                         (job_id, value, limit)).fetchall()
    return [TakenGroup(int(k), g, int(size), bool(stale), tuple(
        Delivery(int(s), tid, r) for s, tid, r, _ in conn.execute(_MEMBERS, (job_id, g))))
        for k, g, size, stale in found]


def taken_groups(conn: sqlite3.Connection, job_id: str, after: int,
                 limit: int) -> list[TakenGroup]:
    """Groups handed out with take numbers after `after` (read back, a page)."""
    rows.require_job(conn, job_id)
    return _taken(conn, job_id, "taken > ?", after, limit)


def stale_members(conn: sqlite3.Connection, job_id: str,
                  min_fresh: int) -> list[tuple[Delivery, int]]:
    """Finished current members of groups not handed out whose oldest sampled
    token is older than `min_fresh`, with that version."""
    found = conn.execute(
        "SELECT t.seq, t.trajectory_id, t.record, t.first_version FROM trajectories t "
        "JOIN job_groups g ON g.job_id = t.job_id AND g.group_id = t.group_id "
        "WHERE t.job_id = ? AND g.taken IS NULL AND t.superseded = 0 AND "
        "t.first_version < ? ORDER BY t.pos", (job_id, min_fresh)).fetchall()
    return [(Delivery(int(s), tid, r), int(v)) for s, tid, r, v in found]


def restart(conn: sqlite3.Connection, job_id: str, trajectory_id: str,
            new: PlannedTrajectory, version: int, sampled: int, reason: str,
            now: float) -> int | None:
    """Supersede a member by `new` (same group and repetition), at policy version
    `version` (the served one, recorded in its `stale_restart` event); the tokens
    discarded (its record's, or `sampled` if it had not finished: then it is
    delivered as aborted with `reason`). None, and nothing done, if its group was
    handed out meanwhile or it was superseded already."""
    row = conn.execute("SELECT t.seq, t.status, t.record, t.attempts, t.superseded, "
                       "t.group_id, t.repetition, t.task_id, g.taken FROM trajectories t "
                       "JOIN job_groups g ON g.job_id = t.job_id AND g.group_id = t.group_id "
                       "WHERE t.job_id = ? AND t.trajectory_id = ?",
                       (job_id, trajectory_id)).fetchone()
    if row is None:
        raise NotFound(f"job {job_id!r} has no group member {trajectory_id!r}")
    seq, status, record, attempts, superseded, group_id, repetition, task_id, taken = row
    if superseded or taken is not None or rows.job_info(conn, job_id).status.terminal:
        return None
    if (new.group_id, new.repetition) != (group_id, repetition):
        raise StoreConflict(f"{new.trajectory_id!r} is not a restart of {trajectory_id!r}")
    rows.add_planned(conn, job_id, [new])  # first: the job must not complete in between
    conn.execute("UPDATE trajectories SET superseded = 1 WHERE job_id = ? AND "
                 "trajectory_id = ?", (job_id, trajectory_id))
    if seq is None:
        discarded = sampled
        t = Trajectory(trajectory_id, GroupKey(group_id, int(repetition)), task_id=task_id,
                       status=TrajectoryStatus.ABORTED, reason=reason,
                       attempt=max(int(attempts) - 1, 0), timings=Timings(finished_at=now))
        rows.deliver(conn, job_id, trajectory_id, TrajectoryStatus(status),
                     TrajectoryStatus.ABORTED, reason, dumps_record(trajectory_to_record(t)),
                     now)
    else:
        discarded = int(json.loads(record)["output_tokens"])
        conn.execute("UPDATE job_groups SET done = done - 1, ready_seq = NULL WHERE "
                     "job_id = ? AND group_id = ?", (job_id, group_id))
    rows.event(conn, job_id, trajectory_id, "stale_restart",
               {"restarted_as": new.trajectory_id, "tokens_discarded": discarded,
                "policy_version": version}, now)
    return discarded

"""The turn journal: each unfinished trajectory's completed turns, so a restart
resumes it from its last turn instead of its prompt.

A row is one completed turn of one attempt (`kind` "turn", `n` its index), one
resume (`kind` "resume", `n` the attempt that resumed) or what a gateway session is
(`kind` "spec", `n` 0: its spec, to open it again), its body bytes the caller's
(MessagePack: `treadle.agent.journal` and `treadle.service.session_journal` say what
they hold); the store does not read bodies.
The statements run inside the transaction of the `Store` call that uses them.

Contracts:

- Only live work is journaled: `append` writes a row only while its trajectory is
  unfinished and the attempt named is its latest (a late batch of a cancelled
  trajectory, or of an attempt a restart has replaced, is dropped and counted out).
- A finished trajectory has no journal: `Store.finish` deletes its rows, `cancel` and
  `fail` their job's, in the same transaction (a crash between the two cannot leave
  rows behind); deleting a job deletes its rows (foreign key).
- `resume` records where an attempt took over and drops the turns it did not keep,
  so a later resume never mixes turns of two different histories.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass

TURN, RESUME, SPEC = "turn", "resume", "spec"  # row kinds
_IN = 500  # ids per IN (...) list: under SQLite's default limit of 999 parameters


@dataclass(frozen=True, slots=True)
class JournalRow:
    """One completed turn of one attempt, as the writer hands it to the store."""

    job_id: str
    trajectory_id: str
    attempt: int  # the attempt index that ran it (`Store.start`'s answer)
    turn: int  # its index in the trajectory, from 0
    tokens: int  # tokens it sampled (kept on the row: counted without parsing bodies)
    body: bytes  # the caller's encoding
    kind: str = TURN  # TURN, or SPEC (`turn` 0)


@dataclass(frozen=True, slots=True)
class JournalResume:
    """Attempt `attempt` of a trajectory resumes with its first `kept` turns (`resume`)."""

    job_id: str
    trajectory_id: str
    attempt: int
    kept: int
    body: bytes  # the caller's encoding of the resume


@dataclass(frozen=True, slots=True)
class JournalWrite:
    """What `write` did: the turn rows written, and the seconds it took (SQLite's,
    before the commit)."""

    rows: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Journaled:
    """A trajectory's journal: its turns in order, and the resumes before this one."""

    turns: tuple[bytes, ...]  # bodies, turn 0 first (dense: a gap ends the list)
    resumes: tuple[bytes, ...]  # bodies, oldest first
    tokens: int  # sampled tokens of `turns`
    spec: bytes | None = None  # a gateway session's spec body


def append(conn: sqlite3.Connection, rows: Sequence[JournalRow]) -> int:
    """Write the rows of live attempts (module docstring); returns how many. One query
    per job finds its live attempts, one statement writes the rows."""
    live: dict[tuple[str, str], int] = {}
    by_job: dict[str, set[str]] = {}
    for r in rows:
        by_job.setdefault(r.job_id, set()).add(r.trajectory_id)
    for job_id, ids in by_job.items():
        listed = sorted(ids)
        for start in range(0, len(listed), _IN):
            chunk = listed[start:start + _IN]
            live.update(((job_id, tid), int(attempts)) for tid, attempts in conn.execute(
                "SELECT trajectory_id, attempts FROM trajectories WHERE job_id = ? AND "
                f"seq IS NULL AND trajectory_id IN ({', '.join('?' * len(chunk))})",
                (job_id, *chunk)))
    kept = [(r.job_id, r.trajectory_id, r.kind, r.turn, r.tokens, r.body) for r in rows
            if live.get((r.job_id, r.trajectory_id)) == r.attempt + 1]
    conn.executemany("INSERT OR REPLACE INTO journal (job_id, trajectory_id, kind, n, tokens, "
                     "body) VALUES (?, ?, ?, ?, ?, ?)", kept)
    return len(kept)


def write(conn: sqlite3.Connection, entries: Sequence[JournalRow | JournalResume]
          ) -> JournalWrite:
    """Turns (`append`, consecutive ones in one statement) and resumes (`resume`) in
    the order given: a resume drops the turns before it that it does not keep, never
    those after it."""
    started = time.perf_counter()
    written = 0
    turns: list[JournalRow] = []
    for entry in [*entries, None]:
        if isinstance(entry, JournalRow):
            turns.append(entry)
            continue
        if turns:
            written += append(conn, turns)
            turns = []
        if entry is not None:
            resume(conn, entry.job_id, entry.trajectory_id, entry.attempt, entry.kept,
                   entry.body)
    return JournalWrite(written, time.perf_counter() - started)


def read(conn: sqlite3.Connection, job_id: str, trajectory_id: str) -> Journaled:
    rows = conn.execute(
        "SELECT kind, n, tokens, body FROM journal WHERE job_id = ? AND trajectory_id = ? "
        "ORDER BY kind, n", (job_id, trajectory_id)).fetchall()
    turns: list[bytes] = []
    tokens = 0
    for kind, n, sampled, body in rows:
        if kind == TURN and n == len(turns):  # a turn after a gap was never reached
            turns.append(body)
            tokens += int(sampled)
    spec = next((b for k, _, _, b in rows if k == SPEC), None)
    return Journaled(tuple(turns), tuple(b for k, _, _, b in rows if k == RESUME), tokens,
                     spec)


def resume(conn: sqlite3.Connection, job_id: str, trajectory_id: str, attempt: int,
           kept: int, body: bytes) -> None:
    """Attempt `attempt` resumes with the first `kept` turns: the others are dropped,
    and the resume (`body`) recorded."""
    conn.execute("DELETE FROM journal WHERE job_id = ? AND trajectory_id = ? AND kind = ? "
                 "AND n >= ?", (job_id, trajectory_id, TURN, kept))
    conn.execute("INSERT OR REPLACE INTO journal (job_id, trajectory_id, kind, n, tokens, "
                 "body) VALUES (?, ?, ?, ?, 0, ?)", (job_id, trajectory_id, RESUME, attempt,
                                                     body))


def forget(conn: sqlite3.Connection, job_id: str, trajectory_id: str | None = None) -> None:
    """Delete the journal of one trajectory (finished), or of every trajectory of a job
    (cancelled, failed)."""
    if trajectory_id is None:
        conn.execute("DELETE FROM journal WHERE job_id = ?", (job_id,))
    else:
        conn.execute("DELETE FROM journal WHERE job_id = ? AND trajectory_id = ?",
                     (job_id, trajectory_id))

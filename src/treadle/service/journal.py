"""The service's turn journal: running trajectories' completed turns into the store,
batched off their path, and each restarted attempt's resume from it.

    writer = JournalWriter(store, metrics)              # one per service
    journal = writer.attempt(job_id, trajectory_id, attempt)   # an agent TurnJournal
    resume = await writer.resume(job_id, trajectory_id, attempt)  # None: a first run

A trajectory's `journal.turn(entry)` only appends to a list; one background task
writes what has gathered every `interval_s` (or at once past `batch` turns), the
bodies serialised then and the rows written by the store in one transaction
(`Store.write_journal`), so a turn costs its trajectory nothing it waits for. A crash loses the
turns of the last interval, which run again: each such trajectory costs at most one
turn more. Writes keep their order (one writer, one store worker), so a resume's
record always precedes the turns of the attempt that made it. `close` writes what
is left.

Resuming (`resume`): an attempt after the first reads its trajectory's journal and
returns how it resumes (`agent.journal.plan_resume`, given the episode's tools),
recording the resume — and dropping the turns it will not keep — first, in the same
ordered stream. With `from_prompt` (the service's `resume_from="prompt"`) no turn is
kept: every restart runs its trajectories again from their prompts, as before turn
journals, and the records still say what was discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from treadle.agent.journal import JournaledTurn, ResumeFrom, ResumePlan, resume_body
from treadle.service.metrics import Metrics
from treadle.store.aio import AsyncStore
from treadle.store.journal import TURN, JournalResume, JournalRow
from treadle.types import ResumePoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Row:
    job_id: str
    trajectory_id: str
    attempt: int
    n: int  # turn index (0 for a spec)
    tokens: int  # sampled tokens of the turn
    kind: str  # TURN | SPEC
    body: Callable[[], bytes]  # its encoding, done when its batch is written


@dataclass(frozen=True, slots=True)
class _Resumed:
    job_id: str
    trajectory_id: str
    point: ResumePoint


class AttemptJournal:
    """One attempt's `agent.journal.TurnJournal`: its turns go to the writer, which
    counts the tokens of its live reply until its turn is kept. `ended` when the
    attempt is over (its last reply is in its record, not the journal)."""

    def __init__(self, writer: JournalWriter, job_id: str, trajectory_id: str,
                 attempt: int) -> None:
        self._writer = writer
        self._key = (job_id, trajectory_id, attempt)
        self._pending = 0  # tokens of replies whose turn is not complete

    def sampled(self, tokens: int) -> None:
        self._pending += tokens
        self._writer.unjournaled += tokens

    def turn(self, entry: JournaledTurn) -> None:
        self._writer.unjournaled -= self._pending
        self._pending = 0
        self._writer.add(_Row(*self._key, entry.index, entry.tokens, TURN, entry.encode))

    def turn_body(self, index: int, tokens: int, body: bytes) -> None:
        """`turn` of a turn encoded elsewhere (a runner actor's)."""
        self._writer.unjournaled -= self._pending
        self._pending = 0
        self._writer.add(_Row(*self._key, index, tokens, TURN, lambda: body))

    def resumed(self, point: ResumePoint) -> None:
        """The attempt's resume, planned elsewhere (a runner actor's)."""
        self._writer.resumed(self._key[0], self._key[1], point)

    def ended(self) -> None:
        self._writer.unjournaled -= self._pending
        self._pending = 0


class JournalWriter:
    """Batches journal writes (module docstring); `start` it on the service's loop."""

    def __init__(self, store: AsyncStore, metrics: Metrics, *, interval_s: float = 0.05,
                 batch: int = 512, from_prompt: bool = False) -> None:
        self.store = store
        self.metrics = metrics
        self.interval_s = interval_s  # how long a batch may gather
        self.batch = batch  # written at once past this many
        self.from_prompt = from_prompt  # restarts keep no turn (module docstring)
        self._ops: list[_Row | _Resumed] = []
        # Tokens sampled that a crash now would throw away: live replies whose turn is
        # not complete, and complete turns not written yet (`treadle_tokens_unjournaled`).
        self.unjournaled = 0
        self._waiting = asyncio.Event()
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def attempt(self, job_id: str, trajectory_id: str, attempt: int) -> AttemptJournal:
        return AttemptJournal(self, job_id, trajectory_id, attempt)

    async def resume(self, job_id: str, trajectory_id: str,
                     attempt: int) -> ResumePlan | None:
        """How attempt `attempt` (`Store.start`'s answer) of a trajectory resumes:
        None for a first attempt, else a plan its runner calls with its episode's
        tools' replay kinds (None: it has no tools) once the episode is up."""
        source = await self.resume_from(job_id, trajectory_id, attempt)
        if source is None:
            return None
        return source.planner(functools.partial(self.resumed, job_id, trajectory_id))

    async def resume_from(self, job_id: str, trajectory_id: str,
                          attempt: int) -> ResumeFrom | None:
        """What attempt `attempt` resumes from, for a runner elsewhere to plan (its
        resume's point comes back to `resumed`); None for a first attempt."""
        if attempt == 0:
            return None
        journaled = await self.store.journaled(job_id, trajectory_id)
        return ResumeFrom(attempt, journaled.turns, journaled.resumes, self.from_prompt)

    def row(self, job_id: str, trajectory_id: str, attempt: int, n: int, tokens: int,
            kind: str, body: Callable[[], bytes]) -> None:
        """Journal a row of another kind of body (a gateway session's spec and calls:
        `service.session_journal`); `body` is rendered when its batch is written."""
        self.add(_Row(job_id, trajectory_id, attempt, n, tokens, kind, body))

    def resumed(self, job_id: str, trajectory_id: str, point: ResumePoint) -> None:
        """Record a resume (planned here, by a gateway session opened again, or by a
        runner actor)."""
        self.add(_Resumed(job_id, trajectory_id, point))

    def add(self, op: _Row | _Resumed) -> None:
        if isinstance(op, _Resumed):
            self.metrics.resumes["turn" if op.point.turn else "prompt"] += 1
            self.metrics.resume_discarded_tokens += op.point.discarded_tokens
        self._ops.append(op)
        if isinstance(op, _Row):
            self.unjournaled += op.tokens
        self._waiting.set()
        if len(self._ops) >= self.batch:
            self._full.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop, after writing every turn handed in (a flush under way is not cut)."""
        self._closing = True
        self._waiting.set()
        self._full.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self._flush()

    async def _run(self) -> None:
        while not self._closing:
            await self._waiting.wait()
            # Let a batch gather (a turn waits for nothing here: it was handed in).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._full.wait()
            try:
                await self._flush()
            except Exception:  # a batch lost costs its turns again after a restart, no more
                log.exception("the turn journal could not write a batch")

    async def _flush(self) -> None:
        ops, self._ops = self._ops, []
        self._waiting.clear()
        self._full.clear()
        if ops:
            try:
                done = await self.store.write_journal([_entry(op) for op in ops])
            finally:  # written, or lost: no longer waiting either way
                self.unjournaled -= sum(op.tokens for op in ops if isinstance(op, _Row))
            self.metrics.journal_flushes.observe(done.seconds)
            self.metrics.journal_turns += done.rows


def _entry(op: _Row | _Resumed) -> JournalRow | JournalResume:
    """An op as the store takes it, its body encoded now, on the loop (a runner
    actor's turn comes encoded already; the store may be in another process, where a
    closure cannot go)."""
    if isinstance(op, _Row):
        return JournalRow(op.job_id, op.trajectory_id, op.attempt, op.n, op.tokens,
                          op.body(), op.kind)
    point = op.point
    return JournalResume(op.job_id, op.trajectory_id, point.attempt, point.turn,
                         resume_body(point))


__all__ = ["AttemptJournal", "JournalWriter"]

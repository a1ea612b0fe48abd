"""The service's side of the harness gateway: sessions as trajectories of jobs.

A session's trajectory always belongs to a job, so that it is delivered on a job's
NDJSON stream like any other:

- a session created without a job gets a job of its own (one group, one sample;
  the job's id is the session's);
- a session created with the id of a *sessions job* (`POST /v1/jobs` with
  ``tasks: {"sessions": ...}``) takes one of its planned trajectories: the one at
  ``group_id``/``repetition`` if given, else the next free one of ``group_id``,
  else the next free one of the job;
- a sub-agent (``parent_session_id``) joins its parent's job as a trajectory added
  to the plan, in group ``<parent's group>/sub`` with repetition
  ``parent's repetition × 1024 + its index among the parent's children``.

A sessions job's rubric (`JobRequest.rubric`) scores a session its owner ends with
a reward, before it is delivered (`service.judging`); a harness job's, its runs.

A session's calls run on the policy's runtime, or on the *frozen pool*'s (a second
runtime over engines at a pinned version, which weight updates never reach, whose
tokens carry that version) when it is not trainable and the service has one, or
when it asks for it (`SessionRequest.engine_pool`).

A harness job's run (`service.harness_runs`) drives a session of its own, and
serves the task's episode's tools to its harness where the task needs a sandbox
(`tools`).

A session's trajectory is marked started in the store when the session is created
and stored when it ends (`gateway.session` says how a session ends). A service
that restarts forgets its open sessions: `Rollouts.start` finishes their
trajectories as errors (stage runtime) and leaves a sessions job's untaken
trajectories for harnesses to take. A cancelled job's open sessions end at once
(their trajectories are already stored as aborted).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from treadle.agent.chat import DEFAULT_FORMAT, Message, chat_format
from treadle.agent.fingerprint import tokenizer_fingerprint
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import MONOTONIC, Clock
from treadle.gateway.errors import SessionBusy, UnknownTool
from treadle.gateway.harness import Harness
from treadle.gateway.session import (
    CallRequest,
    CallResult,
    Session,
    SessionLimits,
    SessionSpec,
    no_call_served,
)
from treadle.gateway.sessions import Sessions
from treadle.gateway.tools import SessionTools
from treadle.runtime.contract import TrajectoryHost
from treadle.runtime.driver import Runtime
from treadle.runtime.suite_pools import SuitePools
from treadle.service.errors import RequestRefused
from treadle.service.harness_runs import HarnessRuns
from treadle.service.judging import Judging
from treadle.service.keys import SessionKeys
from treadle.service.outbox import Outbox
from treadle.service.planning import HarnessWork
from treadle.service.schemas import (
    JobRequest,
    SessionCreated,
    SessionEndRequest,
    SessionRequest,
    SessionTasks,
    SessionView,
)
from treadle.service.session_journal import SessionJournal
from treadle.store.aio import AsyncStore
from treadle.store.errors import NotFound, RecordError, StoreConflict
from treadle.store.jobs import PlannedTrajectory, TrajectoryState
from treadle.types import (
    FailureStage,
    GroupKey,
    KVAcrossUpdates,
    RewardSource,
    Trajectory,
    TrajectoryStatus,
)

log = logging.getLogger(__name__)
MAX_CHILDREN = 1024  # sub-agent sessions of one session (their repetitions' stride)
# A session's max_total_tokens where it asks none and its engines do not say theirs.
DEFAULT_MAX_TOTAL_TOKENS = SessionLimits().max_total_tokens


class Gateway:
    """Sessions over one service's runtime and store (module docstring)."""

    def __init__(self, runtime: Runtime, store: AsyncStore, outbox: Outbox,
                 sandboxes: SuitePools, tokenizer: Tokenizer | None, *,
                 default_format: str = DEFAULT_FORMAT, clock: Clock = MONOTONIC,
                 max_sessions: int = 4096, grace_s: float = 300.0,
                 harnesses: Mapping[str, Harness] | None = None,
                 url: str | None = None, keys: SessionKeys,
                 frozen: Runtime | None = None, journal: SessionJournal | None = None,
                 judging: Judging | None = None, turns: TrajectoryHost | None = None
                 ) -> None:
        self.store = store
        self.outbox = outbox  # where ended sessions' trajectories go
        self.sandboxes = sandboxes  # the suites' pools (a harness run's verifier)
        # What trainers compare their tokenizer with (`agent.fingerprint`).
        self.tokenizer_fingerprint = (None if tokenizer is None
                                      else tokenizer_fingerprint(tokenizer))
        self.frozen = frozen  # the frozen pool's runtime (None: the service has none)
        self.default_format = default_format  # the served model's chat format
        self.harnesses = dict(harnesses or {})  # the harness commands jobs may name
        # Where harnesses reach this service (set by whoever serves it, if not given).
        self.url = url
        # Sessions' keys: a harness run gets its session's, never the service's token.
        self.keys = keys
        self.harnessed: set[str] = set()  # trajectories a harness run returns itself
        self.sessions = None if tokenizer is None else Sessions(
            runtime, tokenizer, on_end=self._ended, clock=clock, max_sessions=max_sessions,
            grace_s=grace_s, turns=turns)
        self._runtime = runtime
        self._windows: dict[str, int | None] = {}  # engine id -> its context window
        self._jobs: dict[str, str] = {}  # trajectory id -> its job, for open sessions
        self._taken: dict[str, set[str]] = {}  # sessions job -> trajectory ids taken here
        # Trainers' sessions journaled, to open them again after a restart (None: not).
        self.journal = journal
        # Sessions jobs' rubrics (None: not judged), and what their judges see of the
        # sessions their owners ended: trajectory id -> (conversation, chat format).
        self.judging = judging
        self._shown: dict[str, tuple[list[Message], str]] = {}
        self.runs = HarnessRuns(self)  # harness jobs' runs, and the tools served to them

    # -- sessions ---------------------------------------------------------------------

    async def create(self, request: SessionRequest, base_url: str, *,
                     owner: str | None = None) -> SessionCreated:
        """A new session of trainer run `owner` (None: the admin's; a job made for it
        is owner's); RequestRefused naming the field for what cannot be made,
        ServiceBusy when `max_sessions` are open."""
        sessions = self._open()
        sessions.check_room()  # before a job is made for it
        fmt = request.chat_format or self.default_format
        try:
            chat_format(fmt)
        except ValueError as e:
            raise RequestRefused(f"chat_format: {e}") from None
        pool, runtime = self._pool(request)
        max_total = await self._max_total(runtime, request.limits.max_total_tokens)
        session_id = uuid.uuid4().hex[:16]
        parent = None
        if request.parent_session_id is not None:
            parent = sessions.open_parent(request.parent_session_id)
            job_id, planned = await self._child_slot(parent)
        elif request.job_id is not None:
            job_id = request.job_id
            planned = await self._take(job_id, request.group_id, request.repetition)
        else:
            job_id = session_id
            planned = PlannedTrajectory(f"{job_id}/{session_id}/0", f"{job_id}/{session_id}",
                                        session_id, 0)
            await self.store.create_job(job_id, {"request": JobRequest(
                tasks=SessionTasks(sessions=[session_id]), job_id=job_id).model_dump(
                    mode="json")}, [planned], owner=owner)
        if await self.store.start(job_id, planned.trajectory_id) is None:
            raise StoreConflict(f"trajectory {planned.trajectory_id} of job {job_id} has "
                                "already ended")
        limits = request.limits
        sampling = request.sampling
        spec = SessionSpec(
            session_id=session_id, trajectory_id=planned.trajectory_id, job_id=job_id,
            key=GroupKey(planned.group_id, planned.repetition), task_id=planned.task_id,
            sampling=Sampling(sampling.temperature, sampling.top_p, sampling.seed),
            limits=SessionLimits(limits.max_turns, max_total, limits.max_tokens_per_turn,
                                 limits.idle_timeout_s),
            metadata=request.metadata,
            parent_id=None if parent is None else parent.spec.session_id,
            trainable=request.trainable, chat_format=fmt, engine_pool=pool,
            kv_across_updates=KVAcrossUpdates(request.kv_across_updates))
        try:
            # The parent may have ended, or the sessions filled, during the awaits above.
            sessions.create(spec, runtime)
        except BaseException:
            # Started in the store with no session to end it: its job must still end.
            await self.outbox.deliver(job_id, Trajectory(
                planned.trajectory_id, spec.key, task_id=planned.task_id,
                status=TrajectoryStatus.ERROR, failure_stage=FailureStage.RUNTIME,
                reason="runtime: its session could not be opened"))
            raise
        self._jobs[planned.trajectory_id] = job_id
        return SessionCreated(session_id=session_id, job_id=job_id,
                              trajectory_id=planned.trajectory_id, max_total_tokens=max_total,
                              tokenizer_fingerprint=self.tokenizer_fingerprint,
                              base_url=f"{base_url.rstrip('/')}/v1/sessions/{session_id}"
                                       "/openai/v1")

    async def context_window(self, runtime: Runtime | None = None) -> int | None:
        """The longest context every engine of the pool serves (the policy's by
        default; `Engine.context_window`, asked once per engine), or None where none
        says."""
        windows = []
        for slot in (runtime or self._runtime).engines():
            if slot.engine_id not in self._windows:
                self._windows[slot.engine_id] = await slot.engine.context_window()
            window = self._windows[slot.engine_id]
            if window is not None:
                windows.append(window)
        return min(windows, default=None)

    async def _max_total(self, runtime: Runtime | None, asked: int | None) -> int:
        """A new session's max_total_tokens: what it asked for, which must fit the
        engines' context (RequestRefused naming it), else that context (else
        `DEFAULT_MAX_TOTAL_TOKENS` where the engines do not say)."""
        window = await self.context_window(runtime)
        if asked is None:
            return DEFAULT_MAX_TOTAL_TOKENS if window is None else window
        if window is not None and asked > window:
            raise RequestRefused(f"limits.max_total_tokens: {asked} is more than the engines' "
                                 f"context ({window} tokens); leave it out to get that")
        return asked

    def _pool(self, request: SessionRequest) -> tuple[str, Runtime | None]:
        """The engine pool a new session's calls go to, and its runtime (None: the
        policy's); RequestRefused for a frozen pool the service does not have."""
        frozen = self.frozen
        has_frozen = frozen is not None and bool(frozen.engines())
        if request.engine_pool == "frozen" and not has_frozen:
            raise RequestRefused("engine_pool: this service has no frozen engines "
                                 "(treadle serve --frozen-engine, or POST /v1/engines with "
                                 "pool frozen)")
        if request.engine_pool == "frozen" or (request.engine_pool is None and has_frozen
                                                and not request.trainable):
            return "frozen", frozen
        return "policy", None

    def opened(self, session_id: str, owner: str | None, key: str) -> None:
        """A session made through the API has its key: from now on it is journaled."""
        if self.journal is not None:
            self.journal.opened(self._open().get(session_id), owner, key)

    async def call(self, session_id: str, request: CallRequest,
                   body: Mapping[str, Any] | None = None) -> CallResult:
        """Serve a call (`body`: the request as sent, journaled for a trainer's session)."""
        sessions = self._open()
        session = sessions.get(session_id)
        result = await sessions.call(session_id, request)
        if self.journal is not None and body is not None and \
                session.spec.trajectory_id not in self.harnessed:
            self.journal.called(session, body, result)
        return result

    async def restore(self, job_id: str, states: Sequence[TrajectoryState]
                      ) -> list[TrajectoryState]:
        """Open again the sessions among `states` (a job's, started before a restart)
        that journaled themselves (`service.session_journal`), their calls replayed;
        returns the others (a harness run's; one whose parent could not be opened),
        which end as errors."""
        if self.journal is None or self.sessions is None:
            return list(states)
        reopened: set[str] = set()
        for js in await self.journal.interrupted(job_id, states):
            spec = js.spec
            runtime = self.frozen if spec.engine_pool == "frozen" else None
            session = None
            try:
                attempt = await self.store.start(job_id, spec.trajectory_id)
                if attempt is None:  # (finished meanwhile: nothing to open)
                    reopened.add(spec.trajectory_id)
                    continue
                session = self.sessions.create(spec, runtime,
                                               replay=[out for _, out in js.calls])
                await self.journal.replay(session, js, attempt)
            except Exception as e:  # it ends as a session the restart ended
                log.warning("session %s could not be opened again: %s", spec.session_id, e)
                if session is not None:
                    session.finish(TrajectoryStatus.ERROR, f"runtime: {e}", FailureStage.RUNTIME)
                    self.sessions.forget(spec.session_id)
                continue
            self._jobs[spec.trajectory_id] = job_id
            self.keys.restore(spec.session_id, js.key_digest, js.owner)
            reopened.add(spec.trajectory_id)
        return [s for s in states if s.trajectory_id not in reopened]

    async def end(self, session_id: str, request: SessionEndRequest) -> SessionView:
        sessions = self._open()
        session = sessions.get(session_id)
        if session.spec.trajectory_id in self.harnessed:
            # Its harness run judges and scores it: nothing holding a key inside the
            # run may set its own reward.
            raise SessionBusy(f"session {session_id} belongs to a harness run, which ends "
                              "it", param="session_id")
        status = TrajectoryStatus(request.status)
        stage = FailureStage.HARNESS if status is TrajectoryStatus.ERROR else None
        reason = request.reason
        if reason is None and status is not TrajectoryStatus.COMPLETED:
            reason = "ended by its owner"
        self._shown[session.spec.trajectory_id] = (session.conversation.context.history,
                                                   session.spec.chat_format)
        await sessions.end(session_id, status=status, reason=reason, reward=request.reward,
                           rewards=request.rewards, metadata=request.metadata, stage=stage,
                           reward_source=RewardSource.OWNER)
        return self.viewed(session)

    def view(self, session_id: str) -> SessionView:
        return self.viewed(self._open().get(session_id))

    def viewed(self, session: Session) -> SessionView:
        """`view` with the service's tokenizer fingerprint."""
        return view(session).model_copy(
            update={"tokenizer_fingerprint": self.tokenizer_fingerprint})

    def session(self, session_id: str) -> Session:
        return self._open().get(session_id)

    def token_text(self, token_id: int) -> str:
        """How one token id reads (for OpenAI's per-token logprobs)."""
        return self._open().tokenizer.decode([token_id])

    async def close(self) -> None:
        if self.sessions is not None:
            await self.sessions.close()

    # -- internals --------------------------------------------------------------------

    def _open(self) -> Sessions:
        if self.sessions is None:
            raise RequestRefused("tokenizer: this service has no tokenizer for its model "
                                 "(start it with --tokenizer), so it cannot render chats")
        return self.sessions

    async def _take(self, job_id: str, group: str | None,
                    repetition: int | None) -> PlannedTrajectory:
        """A free planned trajectory of a sessions job (module docstring)."""
        try:
            spec = await self.store.job_spec(job_id)
        except NotFound:
            raise RequestRefused(f"job_id: no job {job_id!r}") from None
        if "sessions" not in spec.get("request", {}).get("tasks", {}):
            raise RequestRefused(f"job_id: job {job_id!r} is not a sessions job")
        taken = self._taken.setdefault(job_id, set())
        for state in await self.store.unfinished(job_id):
            if state.trajectory_id in taken or state.status is not TrajectoryStatus.PENDING:
                continue
            if group is not None and state.task_id != group:
                continue
            if repetition is not None and state.repetition != repetition:
                continue
            taken.add(state.trajectory_id)
            return PlannedTrajectory(state.trajectory_id, state.group_id, state.task_id,
                                     state.repetition)
        where = f"group {group!r}" + (f" repetition {repetition}" if repetition is not None
                                      else "") if group is not None else "the job"
        raise StoreConflict(f"job {job_id!r}: {where} has no session left to take")

    async def _child_slot(self, parent: Session) -> tuple[str, PlannedTrajectory]:
        # Reserved before any await: sub-agents made at once get distinct slots.
        k = parent.reserved_children
        parent.reserved_children += 1
        if k >= MAX_CHILDREN:
            raise RequestRefused(f"parent_session_id: a session has at most {MAX_CHILDREN} "
                                 "sub-agent sessions")
        spec = parent.spec
        planned = PlannedTrajectory(f"{spec.trajectory_id}/sub/{k}", f"{spec.key.group_id}/sub",
                                    spec.task_id, spec.key.repetition * MAX_CHILDREN + k)
        await self.store.add_trajectories(spec.job_id, [planned])
        return spec.job_id, planned

    def job_cancelled(self, job_id: str) -> None:
        """A cancelled job's open sessions end at once (their trajectories are stored as
        aborted already)."""
        if self.sessions is not None:
            for traj in self.sessions.abort_job(job_id):
                self._jobs.pop(traj.trajectory_id, None)
                self._shown.pop(traj.trajectory_id, None)
        self._taken.pop(job_id, None)

    async def _ended(self, traj: Trajectory) -> None:
        job_id = self._jobs.pop(traj.trajectory_id)
        taken = self._taken.get(job_id)
        if taken is not None:  # a sessions job's slot, taken here and now done
            taken.discard(traj.trajectory_id)
        shown = self._shown.pop(traj.trajectory_id, None)
        if traj.trajectory_id in self.harnessed:
            return  # its harness run hands it to the job runner, which stores it
        no_call_served(traj)
        if shown is not None and traj.reward is not None and self.judging is not None:
            traj = await self.judging.judged_session(  # its job's rubric, if any
                await self.store.job_spec(job_id), traj, *shown)
        try:
            await self.outbox.deliver(job_id, traj)
        except RecordError as e:  # a record the store refuses must not leave it running
            log.error("session trajectory %s: %s", traj.trajectory_id, e)
            await self.outbox.deliver(job_id, Trajectory(
                traj.trajectory_id, traj.key, task_id=traj.task_id,
                status=TrajectoryStatus.ERROR, failure_stage=FailureStage.RUNTIME,
                reason=f"runtime: its record was refused: {e}"))

    # -- harness jobs -----------------------------------------------------------------

    async def run_harness(self, work: HarnessWork, attempt: int) -> Trajectory:
        """One trajectory of a harness job (`service.harness_runs`); never raises but
        CancelledError."""
        return await self.runs.run(work, attempt)

    def tools(self, session_id: str) -> SessionTools:
        """The tools served to an open session (`service.harness_runs`): UnknownSession
        (404) for no open session, UnknownTool (404) for one served none."""
        self._open().get(session_id)
        served = self.runs.served.get(session_id)
        if served is None:
            raise UnknownTool(f"session {session_id} is served no tools (only a harness "
                              "job's session whose task needs a sandbox is)")
        return served

    def open_sessions(self) -> Sessions:
        return self._open()

    def track(self, trajectory_id: str, job_id: str) -> None:
        """An open session's trajectory belongs to `job_id` (until it ends)."""
        self._jobs[trajectory_id] = job_id

    def untrack(self, trajectory_id: str) -> None:
        self._jobs.pop(trajectory_id, None)


def view(session: Session) -> SessionView:
    traj = session.trajectory
    return SessionView(session_id=session.spec.session_id, job_id=session.spec.job_id,
                       trajectory_id=traj.trajectory_id, status=traj.status.value,
                       turns=len(traj.turns), segments=session.segments,
                       reward=traj.reward, children=[c.spec.trajectory_id
                                                     for c in session.children],
                       engine_pool=session.spec.engine_pool)


__all__ = ["Gateway", "view"]

"""Gateway sessions across a restart: what is journaled of a trainer's session, and
what opens it again.

A session opened through the API journals its spec (`spec_body`: the `SessionSpec`,
its owner and its key's digest) once its key is granted, and each call it served
(`call_body`: the chat request as the harness sent it, and the runner's whole
reply), through the service's `JournalWriter`. A service restarted on the same
store opens each such session again (`Gateway.restore`): the same id and key, its
calls replayed through the session as they were first served — each reply the
journal's, no engine — so its token context and record are the first attempt's and
the harness's next call finds the session where it left it. A harness run's
sessions (the harness died with the service) are not journaled: they end as before.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.agent.journal import (
    BAD_BODY,
    decode,
    dump_output,
    encode,
    load_output,
    load_points,
)
from treadle.agent.runner import Sampling, TurnOutput
from treadle.gateway import wire
from treadle.gateway.session import CallResult, Session, SessionLimits, SessionSpec
from treadle.service.journal import JournalWriter
from treadle.service.keys import digest
from treadle.store.aio import AsyncStore
from treadle.store.jobs import TrajectoryState
from treadle.store.journal import SPEC, TURN
from treadle.types import GroupKey, KVAcrossUpdates, ResumePoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JournaledSession:
    """A session as its journal opens it again."""

    spec: SessionSpec
    owner: str | None  # the trainer run whose session it is (None: the admin's)
    key_digest: bytes  # its key's (the harness holds the key)
    calls: tuple[tuple[dict[str, Any], TurnOutput], ...] = ()  # (request, reply), in order
    resumed: tuple[ResumePoint, ...] = ()  # earlier resumes


class SessionJournal:
    """The journal's side of a gateway's sessions (module docstring)."""

    def __init__(self, writer: JournalWriter, store: AsyncStore) -> None:
        self.writer = writer
        self.store = store

    def opened(self, session: Session, owner: str | None, key: str) -> None:
        """Journal a session opened through the API, once its key is granted."""
        s = session.spec
        self.writer.row(s.job_id, s.trajectory_id, session.trajectory.attempt, 0, 0, SPEC,
                        functools.partial(spec_body, s, owner, digest(key)))

    def called(self, session: Session, request: Mapping[str, Any], result: CallResult) -> None:
        """Journal a call a journaled session served."""
        s = session.spec
        self.writer.row(s.job_id, s.trajectory_id, session.trajectory.attempt, result.turn,
                        len(result.output.output_ids), TURN,
                        functools.partial(call_body, request, result.output))

    async def interrupted(self, job_id: str, states: Sequence[TrajectoryState]
                          ) -> list[JournaledSession]:
        """The journaled sessions among `states` (a job's, started before a restart),
        each parent before its children; one whose journal does not read is left out
        (it ends as before)."""
        found: dict[str, JournaledSession] = {}
        for state in states:
            journaled = await self.store.journaled(job_id, state.trajectory_id)
            if journaled.spec is None:
                continue
            try:
                session = dataclasses.replace(
                    load_spec(journaled.spec), calls=tuple(load_call(b) for b in journaled.turns),
                    resumed=load_points(journaled.resumes))
                found[session.spec.session_id] = session
            except BAD_BODY as e:
                log.warning("session of trajectory %s: its journal does not read: %s",
                            state.trajectory_id, e)
        ordered: list[JournaledSession] = []
        while found:
            ready = [s for s in found.values() if s.spec.parent_id not in found]
            if not ready:  # (parents are made before their children: no cycle)
                break
            for s in ready:
                ordered.append(found.pop(s.spec.session_id))
        return ordered

    async def replay(self, session: Session, journaled: JournaledSession, attempt: int) -> None:
        """Serve a reopened session's journaled calls again (each answered by its
        recorded reply: `Sessions.create(..., replay=)`), and record the resume."""
        traj = session.trajectory
        traj.attempt = attempt
        traj.resumed = [*journaled.resumed, ResumePoint(attempt, len(journaled.calls))]
        for request, _ in journaled.calls:
            call, _ = wire.parse_chat(request)
            await session.call(call)
        self.writer.resumed(session.spec.job_id, session.spec.trajectory_id,
                            traj.resumed[-1])


def spec_body(spec: SessionSpec, owner: str | None, key_digest: bytes) -> bytes:
    s = spec
    return encode({
        "session_id": s.session_id, "trajectory_id": s.trajectory_id, "job_id": s.job_id,
        "group_id": s.key.group_id, "repetition": s.key.repetition, "task_id": s.task_id,
        "sampling": [s.sampling.temperature, s.sampling.top_p, s.sampling.seed],
        "limits": [s.limits.max_turns, s.limits.max_total_tokens,
                   s.limits.max_tokens_per_turn, s.limits.idle_timeout_s],
        "metadata": dict(s.metadata), "parent_id": s.parent_id, "trainable": s.trainable,
        "chat_format": s.chat_format, "swept": s.swept, "engine_pool": s.engine_pool,
        "kv_across_updates": s.kv_across_updates.value, "owner": owner,
        "key_digest": key_digest})


def load_spec(body: bytes) -> JournaledSession:
    """`spec_body`'s session back (one of `BAD_BODY` if it is not one)."""
    d: dict[str, Any] = decode(body)
    temperature, top_p, seed = d["sampling"]
    max_turns, max_total, per_turn, idle = d["limits"]
    spec = SessionSpec(
        session_id=d["session_id"], trajectory_id=d["trajectory_id"], job_id=d["job_id"],
        key=GroupKey(d["group_id"], int(d["repetition"])), task_id=d["task_id"],
        sampling=Sampling(float(temperature), float(top_p), seed),
        limits=SessionLimits(int(max_turns), int(max_total), int(per_turn), float(idle)),
        metadata=dict(d["metadata"]), parent_id=d["parent_id"], trainable=bool(d["trainable"]),
        chat_format=d["chat_format"], swept=bool(d["swept"]), engine_pool=d["engine_pool"],
        kv_across_updates=KVAcrossUpdates(d["kv_across_updates"]))
    return JournaledSession(spec, d["owner"], bytes(d["key_digest"]))


def call_body(request: Mapping[str, Any], output: TurnOutput) -> bytes:
    return encode({"request": request, "output": dump_output(output)})


def load_call(body: bytes) -> tuple[dict[str, Any], TurnOutput]:
    """`call_body`'s (request, reply) back."""
    d = decode(body)
    return dict(d["request"]), load_output(d["output"])


__all__ = ["JournaledSession", "SessionJournal", "call_body", "load_call", "load_spec",
           "spec_body"]

"""Replaying a workload's trajectory live: the simulator's script, real engine calls.

`replay(spec, turns, clock)` plays one `TrajectorySpec` (a trace line or a
generated workload) through a `TurnRunner`: a synthetic prompt of the spec's
length, then for every turn a call with `max_tokens` set to the turn's length and
no stop token (so the engine samples exactly that many tokens), the tool's latency
slept on the runtime's clock, and an observation of the spec's length appended.
Token ids are synthetic (seeded by the trajectory id) and fall in the emulated
engine's vocabulary; only the counts and the timing are the workload's. Each
turn is recorded as the agent loop records one (engine, queued and generating
seconds, policy version; the tool gap as a `ToolCall` named "replay" with the
latency measured on the clock and the observation's length), so a replayed
trajectory's record shows where its time went. It is how
`treadle bench live` measures the live system on exactly what `treadle sim`
simulates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from treadle.agent.journal import JournaledTurn, TurnJournal
from treadle.agent.runner import Sampling, TurnRunner
from treadle.clock import Clock
from treadle.engines.emulated import VOCAB
from treadle.types import ToolCall, Turn
from treadle.workloads import TrajectorySpec

REPLAY_TOOL = "replay"  # the tool name a replayed tool gap is recorded under


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one replayed trajectory did."""

    traj_id: str
    finished_at: float  # on the runtime's clock
    turn_records: tuple[Turn, ...] = ()  # per turn, as the agent loop records them

    @property
    def output_tokens(self) -> int:
        """Tokens the engines sampled."""
        return sum(t.output_tokens for t in self.turn_records)

    @property
    def queued_s(self) -> float:
        """Waiting for engines, preemptions included."""
        return sum(t.queued_s for t in self.turn_records)


_WORD = array("I").itemsize


def _ids(rng: random.Random, n: int) -> list[int]:
    """`n` ids in the vocabulary, drawn from `rng`: whole words at once, reduced modulo
    VOCAB (5x cheaper than a `randrange` per id, which showed in the service's CPU per
    turn; the bias, below 1 in 28,000, does not matter to synthetic ids)."""
    return [x % VOCAB for x in array("I", rng.randbytes(_WORD * n))]


async def replay(spec: TrajectorySpec, turns: TurnRunner, clock: Clock, *,
                 resume: Sequence[JournaledTurn] = (),
                 journal: TurnJournal | None = None) -> ReplayResult:
    """Play `spec` through `turns`; raises what the runner raises (EngineError).
    Each completed turn goes to `journal`; a restarted attempt's `resume` turns (the
    journal's) are taken as they were, without an engine or a tool gap, and the
    runner hears of the trajectory at its first live turn (`agent.journal`)."""
    seed = hashlib.blake2b(spec.traj_id.encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(seed, "big"))
    context = _ids(rng, spec.prompt_tokens)
    last = len(spec.turns) - 1
    records: list[Turn] = []
    try:
        for index, turn in enumerate(spec.turns):
            if index < len(resume) and index < last:
                kept = resume[index]
                context += kept.output.output_ids
                record = kept.output.turn(index)
                record.tool_call = None if kept.tool_call is None else \
                    dataclasses.replace(kept.tool_call)
                records.append(record)
                context += _ids(rng, turn.tool_output_tokens)
                continue
            out = await turns.generate(context, turn.output_tokens, Sampling(), [])
            context += out.output_ids
            if journal is not None:
                journal.sampled(len(out.output_ids))
            record = out.turn(index)
            records.append(record)
            turns.turn_finished(len(out.output_ids), len(context), final=index == last)
            if index == last:
                break
            turns.tool_started()
            started = clock.now()
            await clock.sleep(turn.tool_latency_s)
            context += _ids(rng, turn.tool_output_tokens)
            record.tool_call = ToolCall(REPLAY_TOOL, {}, max(0.0, clock.now() - started),
                                        turn.tool_output_tokens)
            turns.tool_finished(turn.tool_latency_s, turn.tool_output_tokens, final=False)
            if journal is not None:
                journal.turn(JournaledTurn(index, out, tool_call=record.tool_call))
    except BaseException as e:
        turns.ended(f"replay stopped: {type(e).__name__}")  # a no-op after the final event
        raise
    return ReplayResult(spec.traj_id, clock.now(), tuple(records))

"""Merging idle engines into one of a larger TP degree for the long tail of a step.

A pool chosen for the bulk of a rollout step (many trajectories, where engines of
a low TP degree give the most tokens a GPU) is the wrong pool for its end: a few
long trajectories decode one per engine while the other engines idle, and a
trajectory's per-token time falls with the TP degree (Qwen3-14B on H100 at batch
1: 13.1 ms at TP 1, 8.2 at TP 2, 5.4 at TP 4, 4.1 at TP 8). Heddle's third
mechanism, adaptive parallelism, changes the layout for that reason.

`plan_merge` is the decision, priced by the cost model: stop idle engines whose
GPUs add up to a degree `tp` and start one engine of that degree, when the tail's
predicted finish with the longest trajectories moved there, the restart and the
moves included, beats its finish where it is by `MERGE_MARGIN`. The policy then
places the longest trajectories on the new engine at its next re-plan; they move
in their tool gaps, or a running turn is paused (its tokens kept) and admitted
there when the per-token time it saves pays for the KV move it waits for.
A merge whose engine never comes up (its launch failed) is the last: the policy
starts one merge at a time.

Limits: engines are assumed to sit one node per 8 GPUs and idle engines to share
one (a launcher that packs a TP-8 engine on one node waits for 8 free GPUs there);
a trajectory's remaining time is its predicted remaining tokens at its engine's
present per-token time (tool time left out: a merge that pays in decode pays
more where tools overlap the restart); trajectories left where they are keep their
present time (they speed up as the moved ones leave: the estimate is cautious).
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from treadle.core.cost_model import TP_DEGREES, CostModel
from treadle.core.scheduler import EngineState, Phase, TrajState

# The merged finish must beat the present one by this share: the prediction of a
# tail trajectory's remaining tokens is its least certain, and a merge that does
# not pay still costs the restart's GPUs.
MERGE_MARGIN = 0.15
NODE_GPUS = 8  # GPUs a node holds: the largest engine one merge makes
MAX_MOVED = 64  # most trajectories one merge weighs moving (the tail, not the bulk)


@dataclass(frozen=True, slots=True)
class Merge:
    """Stop `drain` (idle engines) and start one engine of `tp` on their GPUs."""

    drain: tuple[str, ...]  # engines to stop, their GPUs summing to `tp`
    tp: int  # the new engine's TP degree
    moved: tuple[str, ...]  # trajectories predicted to finish sooner there
    finish_now_s: float  # the tail's predicted finish where it is (from now)
    finish_merged_s: float  # ... with `moved` on the new engine, restart included


def idle_engines(engines: Sequence[EngineState], live: Sequence[TrajState]) -> list[EngineState]:
    """Engines with nothing running, queued or parked in a tool gap, not draining."""
    held = {t.engine_id for t in live if t.engine_id is not None}
    return [e for e in engines
            if not e.draining and not e.running and not e.queue and e.engine_id not in held]


def _drainable(idle: Sequence[EngineState], tp: int) -> tuple[str, ...] | None:
    """Idle engines whose GPUs sum to exactly `tp`, largest first (fewest engines)."""
    chosen: list[str] = []
    total = 0
    for e in sorted(idle, key=lambda e: (-e.tp, e.engine_id)):
        if e.tp < tp and total + e.tp <= tp:
            chosen.append(e.engine_id)
            total += e.tp
    return tuple(chosen) if total == tp else None


def tokens_left(t: TrajState, predicted: float, step_s: float, now: float,
                max_context: int) -> float:
    """Output tokens `t` has left: the prediction made at its last turn's end, less
    what a running turn has decoded since its admission (at `step_s` a token: the
    scheduler hears of a turn's tokens only when it ends), and never past the
    context limit."""
    decoded = (now - t.admitted_at) / step_s if t.phase is Phase.RUNNING else 0.0
    return max(1.0, min(predicted, max_context - t.context_tokens) - decoded)


def plan_merge(live: Sequence[TrajState], engines: Sequence[EngineState], cost: CostModel,
               remaining: Callable[[TrajState], float], now: float) -> Merge | None:
    """The merge that most shortens the tail's predicted finish, if one beats it by
    `MERGE_MARGIN`; None otherwise (or with nothing idle, nothing live).

    `live`: the trajectories not finished; `remaining(t)`: predicted output tokens
    left (`tokens_left` corrects it). A trajectory's time where it is: its tokens
    left × the step time of its engine's present batch (the trajectories placed
    there, their contexts). On the new engine of degree d: restart_time(d) + the
    KV move of its context, then its tokens at the step time of the j moved
    together."""
    idle = idle_engines(engines, live)
    if not live or sum(e.tp for e in idle) < min(TP_DEGREES[1:]):
        return None  # first, as it is cheap: nothing idle while the bulk runs
    by_id = {e.engine_id: e for e in engines}
    share: dict[str, list[TrajState]] = {}
    for t in live:
        if t.engine_id in by_id:
            share.setdefault(t.engine_id, []).append(t)
    here: list[tuple[float, TrajState]] = []
    left: dict[str, float] = {}
    for t in live:
        e = by_id.get(t.engine_id) if t.engine_id is not None else None
        if e is None:
            return None  # unplaced work: the bulk is not over
        on = share[e.engine_id]
        step = cost.step_time(e.tp, len(on), float(sum(x.context_tokens for x in on)))
        left[t.traj_id] = tokens_left(t, remaining(t), step, now, cost.model.max_context)
        here.append((left[t.traj_id] * step, t))
    here.sort(key=lambda p: (-p[0], p[1].traj_id))
    finish_now = here[0][0]
    longest_tp = by_id[str(here[0][1].engine_id)].tp
    best: Merge | None = None
    for tp in TP_DEGREES:
        drain = _drainable(idle, tp) if longest_tp < tp <= NODE_GPUS else None
        if drain is None:
            continue
        start, capacity = cost.restart_time(tp), cost.kv_capacity_tokens(tp)
        context = most_move = most_tokens = 0.0
        for j, (_, t) in enumerate(here[:MAX_MOVED], start=1):
            # The moved trajectories' latest finish, bounded above by the longest
            # move plus the most tokens left at the batch's step time: O(1) a step.
            context += t.context_tokens
            if context > capacity:
                break
            most_move = max(most_move, cost.migration_time(t.context_tokens))
            most_tokens = max(most_tokens, left[t.traj_id])
            there = start + most_move + most_tokens * cost.step_time(tp, j, context)
            merged = max(there, here[j][0] if j < len(here) else 0.0)
            if best is None or merged < best.finish_merged_s:
                moved = tuple(x.traj_id for _, x in here[:j])
                best = Merge(drain, tp, moved, finish_now, merged)
    if best is None or best.finish_merged_s >= (1.0 - MERGE_MARGIN) * finish_now:
        return None
    return best


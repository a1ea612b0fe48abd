"""treadle's list placement kept between re-plans, so that a re-plan places only what
changed (`Treadle.plan`).

A full list placement (`list_placement.lpt_placement`) sorts every live trajectory
and places each: over 1,024 engines and 100,000 trajectories that is a few hundred ms
of a single-threaded control plane, every re-plan. Between two re-plans most
trajectories neither finished a turn nor came back from a tool, so their predicted
remaining tokens and context are those they were placed with. `KeptPlacement` keeps
each engine's planned load (`list_placement.Load`) and members; `update` takes out
the trajectories that changed or are gone and places the changed ones again, longest
first, each on the engine whose predicted finish with a typical one of them is least
(`list_placement.place_by_heap`), the others keeping their engine. The cost is that
of the changed trajectories (plus re-finding an engine's longest member when it
left), not of the batch.

Limits: it is not the full placement's answer: a trajectory that did not change keeps
its engine even where a full placement would now move it, and the changed ones are
placed by the heap keyed on a typical one of them, not by the exact search the
full placement gives its longest (`TAIL_PER_ENGINE` per engine). Loads are updated by
subtraction, so their sums drift by float rounding until the next full placement;
the caller places everything afresh when the engines change, when estimates are
renewed and when most trajectories changed. Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from treadle.core.cost_model import CostModel
from treadle.core.policies.list_placement import Load, longest_first, place_by_heap
from treadle.core.scheduler import EngineState

Item = tuple[str, float, float]  # (trajectory id, remaining tokens, context tokens)


def engines_key(engines: Sequence[EngineState]) -> tuple[tuple[str, int], ...]:
    """What a kept placement depends on of the engines: their ids and degrees."""
    return tuple((e.engine_id, e.tp) for e in engines)


class KeptPlacement:
    """A placement's engine loads and members, updated a trajectory at a time."""

    def __init__(self, engines: Sequence[EngineState], items: Sequence[Item],
                 plan: Mapping[str, str]) -> None:
        """Keep `plan` (trajectory -> engine id on one of `engines`) of `items`; an
        item the plan no longer holds (its trajectory ended since) is left out."""
        self.key = engines_key(engines)
        self.ids = [e.engine_id for e in engines]
        index = {eid: i for i, eid in enumerate(self.ids)}
        self.loads = [Load(e.tp) for e in engines]
        # Per engine, a max-heap of its members' (-remaining, id); entries of
        # members gone or placed again since are dropped when they reach the top.
        self.members: list[list[tuple[float, str]]] = [[] for _ in engines]
        self.count = [0] * len(engines)
        self.placed: dict[str, tuple[float, float, int]] = {}  # (rem, ctx, engine index)
        for tid, rem, ctx in items:
            eid = plan.get(tid)
            if eid is not None:
                i = index[eid]
                self.loads[i].add(rem, ctx)
                self.placed[tid] = (rem, ctx, i)
                self.members[i].append((-rem, tid))
                self.count[i] += 1
        for members in self.members:
            heapq.heapify(members)

    def _remove(self, tid: str, headless: set[int]) -> None:
        """Take a placed trajectory out of its engine's load; an engine whose longest
        member it was goes into `headless`."""
        entry = self.placed.pop(tid, None)
        if entry is None:
            return
        rem, ctx, i = entry
        ld = self.loads[i]
        self.count[i] -= 1
        if not self.count[i]:  # empty: exact zeros, no rounding residue
            ld.head = ld.tokens = ld.kv_tokens = 0.0
            self.members[i].clear()
            headless.discard(i)
            return
        ld.tokens -= rem
        ld.kv_tokens -= rem * (ctx + rem / 2.0)
        if rem >= ld.head:
            headless.add(i)

    def _rehead(self, i: int) -> None:
        """The engine's longest member again: its heap's top, once stale entries
        (members gone, or placed again since) are dropped."""
        placed, members = self.placed, self.members[i]
        while members:
            neg_rem, tid = members[0]
            p = placed.get(tid)
            if p is not None and p[2] == i and p[0] == -neg_rem:
                self.loads[i].head = -neg_rem
                return
            heapq.heappop(members)
        self.loads[i].head = 0.0

    def update(self, changed: Sequence[Item], gone: Sequence[str],
               cost: CostModel) -> dict[str, str]:
        """Forget `gone`, place `changed` again (new ones too); the engine id of each
        changed trajectory."""
        headless: set[int] = set()
        for tid in gone:
            self._remove(tid, headless)
        for tid, _, _ in changed:
            self._remove(tid, headless)
        for i in sorted(headless):
            self._rehead(i)
        out: dict[str, str] = {}
        if not changed:
            return out
        place_by_heap(longest_first(changed), self.loads, self.ids, cost, out)
        index = {eid: i for i, eid in enumerate(self.ids)}
        for tid, rem, ctx in changed:
            i = index[out[tid]]
            self.placed[tid] = (rem, ctx, i)
            heapq.heappush(self.members[i], (-rem, tid))
            self.count[i] += 1
        return out

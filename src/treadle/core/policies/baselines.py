"""Step-centric baselines, configured as the Heddle paper ran them.

Each schedules every LLM call (turn) as an independent request and knows nothing
about trajectory lengths. All run FCFS (equal priorities; ties by arrival), on a
homogeneous pool of one TP degree.

- `slime`: slime's router sends every request to the least-loaded engine
  (fewest outstanding requests). A trajectory's turns land wherever load is lowest,
  so its prefix cache is usually on another engine and each turn re-prefills.
- `verl`: verl's agent loop pins a trajectory to the engine picked for its first
  turn (least outstanding requests then), so later turns hit the prefix cache.
- `verl-star` (the paper's verl*): pinned as verl, except that when the most and
  least loaded engines differ by a ratio above 32, the turn goes to the least
  loaded one.

Configuration (RESEARCH.md, Heddle evaluation): TP 1 for Qwen3-8B/14B and TP 2 for
Qwen3-32B, 100 concurrent requests per engine. With a `@tpN` suffix a baseline
runs on a pool of TP-N engines; its concurrency limit then scales with the GPUs
of an engine (100 per paper-sized engine), capped by the engine's own limit, so
a TP-tuned baseline is never starved of requests.
"""

from __future__ import annotations

from treadle.core.policies.layout import homogeneous_pool
from treadle.core.scheduler import EngineState, TrajectoryScheduler, TrajState

PAPER_TP = {"qwen3-8b": 1, "qwen3-14b": 1, "qwen3-32b": 2}
PAPER_CONCURRENCY = 100  # requests in flight per paper-sized engine


class Baseline(TrajectoryScheduler):
    """A homogeneous pool of `tp`-GPU engines; `paper_tp` sets the concurrency unit."""

    name = "baseline"

    def __init__(self, tp: int, paper_tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.paper_tp = paper_tp

    def initial_pool(self, gpus: int) -> list[int]:
        return homogeneous_pool(gpus, self.tp, self.name)

    def admission_cap(self, e: EngineState) -> int:
        return min(e.max_batch, PAPER_CONCURRENCY * max(1, e.tp // self.paper_tp))

    def route(self, t: TrajState, now: float) -> str | None:
        return self.least_loaded()


class Slime(Baseline):
    name = "slime"


class Verl(Baseline):
    name = "verl"

    def route(self, t: TrajState, now: float) -> str | None:
        if t.engine_id is not None and t.engine_id in self.engines \
                and not self.engines[t.engine_id].draining:
            return t.engine_id
        return self.least_loaded()


class VerlStar(Verl):
    name = "verl-star"
    imbalance_ratio = 32.0  # the paper's switch-over threshold

    def route(self, t: TrajState, now: float) -> str | None:
        loads = [e.load for e in self.live_engines()]
        if loads and max(loads) > self.imbalance_ratio * max(1, min(loads)):
            return self.least_loaded()
        return super().route(t, now)

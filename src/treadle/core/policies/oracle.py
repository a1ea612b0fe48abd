"""`oracle`: a reference, not a product policy.

It is told every trajectory's true total output tokens, turns and tool time in
advance (`TruthEstimator`), runs treadle's mechanisms on that perfect knowledge,
and is given the engine layout that its runner found best in hindsight (the
runner simulates several candidate layouts and keeps the fastest). The gap
between `treadle` and `oracle` is what prediction error costs.
"""

from __future__ import annotations

from collections.abc import Mapping

from treadle.core.predictor import Estimate, Outcome


class TruthEstimator:
    """A `WorkEstimator` that knows each trajectory's outcome. It reads the future
    by design; nothing but the oracle may use it."""

    def __init__(self, truth: Mapping[str, Outcome]) -> None:
        self._truth = truth
        self._tokens: dict[str, int] = {}
        self._turns: dict[str, int] = {}
        self._tool_s: dict[str, float] = {}

    def arrived(self, traj_id: str, group_id: str, prompt_tokens: int) -> None:
        if traj_id not in self._truth:
            raise KeyError(f"oracle has no truth for trajectory {traj_id!r}")
        self._tokens[traj_id], self._turns[traj_id], self._tool_s[traj_id] = 0, 0, 0.0

    def turn_finished(self, traj_id: str, output_tokens: int) -> None:
        self._tokens[traj_id] += output_tokens
        self._turns[traj_id] += 1

    def tool_finished(self, traj_id: str, latency_s: float) -> None:
        self._tool_s[traj_id] += latency_s

    def finished(self, traj_id: str) -> None:
        pass

    def forget(self, traj_id: str) -> None:
        self._tokens.pop(traj_id, None)

    def estimate(self, traj_id: str) -> Estimate:
        o = self._truth[traj_id]
        done = self._tokens.get(traj_id, o.output_tokens)
        return Estimate(
            total_tokens=float(o.output_tokens),
            remaining_tokens=float(max(0, o.output_tokens - done)),
            remaining_turns=float(max(0, o.turns - self._turns.get(traj_id, o.turns))),
            remaining_tool_s=max(0.0, o.tool_time_s - self._tool_s.get(traj_id, o.tool_time_s)),
        )

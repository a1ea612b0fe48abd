"""Accuracy of the scheduler's length predictor, measured by replaying trajectories.

`evaluate` is *the* accuracy metric of `treadle.core.predictor.Predictor` (or any
object with its event/estimate interface): what matters to the scheduler is whether
the trajectories that will run longest are recognised early, so the scores are
rank-based (top-20% recall, Spearman) with the relative error of the predicted total
alongside. `make_predictor` swaps in a baseline or an ablation (e.g. a constant, or
`Predictor(history, use_groups=False)`) under the same replay.

Replay model (idealised, no engine contention): every trajectory arrives at time 0,
in input order. Turn i takes ``output_tokens_i × 0.01`` s, then its tool call takes
``tool_latency_s_i``; the last turn's latency is ignored (no tool call follows it,
the trajectory finishes when that turn does). Events reach the predictor in time
order (ties: the earlier-scheduled event first), so short siblings finish, and are
learnt, before long ones reach their later turns — which is what gives group
information its value. A trajectory is `forget`-ed as soon as it has `finished`.

Checkpoint k records a trajectory's predicted total right after its k-th turn
finished (k = 0: right after it arrived), but only for trajectories still running
then, i.e. those with more than k turns; so `n` shrinks with k, and the scores at
k compare the trajectories alive at k among themselves.

Scores per checkpoint (all 0.0 when n == 0):
- ``recall_top20``: of the truly longest m = ceil(n/5), the fraction also among
  the predicted top m. Ties at either cut-off count fractionally, as the expected
  value under random tie-breaking, so a constant predictor scores m/n (about 0.2)
  rather than whatever an ordering of the ties happens to give.
- ``spearman``: Pearson correlation of average ranks (ties averaged); 0.0 when
  either side is constant or n < 2.
- ``mape``: mean of |predicted - true| / max(true, 1).
- ``n``: trajectories scored.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Protocol

from treadle.core.predictor import Estimate, Outcome, Predictor

TOKEN_TIME_S = 0.01  # replay time per output token

Trajectory = tuple[str, str, int, Sequence[tuple[int, float]]]


class LengthPredictor(Protocol):
    """The interface `evaluate` drives (what `Predictor` provides)."""

    def arrived(self, traj_id: str, group_id: str, prompt_tokens: int) -> None: ...
    def turn_finished(self, traj_id: str, output_tokens: int) -> None: ...
    def tool_finished(self, traj_id: str, latency_s: float) -> None: ...
    def finished(self, traj_id: str) -> None: ...
    def forget(self, traj_id: str) -> None: ...
    def estimate(self, traj_id: str) -> Estimate: ...


_TURN_END = 0
_TOOL_END = 1


def evaluate(
    trajectories: Sequence[Trajectory],
    history: Sequence[Outcome],
    checkpoints: Sequence[int] = (0, 1, 2),
    *,
    make_predictor: Callable[[Sequence[Outcome]], LengthPredictor] = Predictor,
) -> dict[int, dict[str, float]]:
    """Replays `trajectories` (traj_id, group_id, prompt_tokens, [(output_tokens,
    tool_latency_s) per turn]) into a predictor warm-started from `history` and
    scores its predicted totals at each checkpoint; returns {k: scores}.

    Raises ValueError for duplicate ids, a trajectory without turns, negative
    tokens or latencies, or a negative checkpoint. Deterministic.
    """
    ks = sorted(set(checkpoints))
    if ks and ks[0] < 0:
        raise ValueError(f"checkpoints must be >= 0, got {ks[0]}")
    wanted = set(ks)
    seen: set[str] = set()
    for traj_id, _, _, turns in trajectories:
        if traj_id in seen:
            raise ValueError(f"duplicate trajectory id {traj_id!r}")
        seen.add(traj_id)
        if not turns:
            raise ValueError(f"trajectory {traj_id!r} has no turns")
        for tokens, latency in turns:
            if tokens < 0 or not (math.isfinite(latency) and latency >= 0.0):
                raise ValueError(f"trajectory {traj_id!r} has a negative turn: {tokens}, {latency}")

    predictor = make_predictor(history)
    predicted: dict[int, list[float]] = {k: [] for k in ks}
    actual: dict[int, list[float]] = {k: [] for k in ks}
    totals = [float(sum(tok for tok, _ in turns)) for _, _, _, turns in trajectories]

    def record(k: int, i: int) -> None:
        if k in wanted:
            predicted[k].append(predictor.estimate(trajectories[i][0]).total_tokens)
            actual[k].append(totals[i])

    queue: list[tuple[float, int, int, int]] = []  # (time, seq, kind, trajectory)
    seq = 0
    for i, (traj_id, group_id, prompt_tokens, turns) in enumerate(trajectories):
        predictor.arrived(traj_id, group_id, prompt_tokens)
        record(0, i)
        heapq.heappush(queue, (turns[0][0] * TOKEN_TIME_S, seq, _TURN_END, i))
        seq += 1
    done_turns = [0] * len(trajectories)
    while queue:
        now, _, kind, i = heapq.heappop(queue)
        traj_id, _, _, turns = trajectories[i]
        k = done_turns[i]
        if kind == _TURN_END:
            predictor.turn_finished(traj_id, turns[k][0])
            done_turns[i] = k = k + 1
            if k == len(turns):
                predictor.finished(traj_id)
                predictor.forget(traj_id)
                continue
            record(k, i)
            heapq.heappush(queue, (now + turns[k - 1][1], seq, _TOOL_END, i))
        else:
            predictor.tool_finished(traj_id, turns[k - 1][1])
            heapq.heappush(queue, (now + turns[k][0] * TOKEN_TIME_S, seq, _TURN_END, i))
        seq += 1

    return {k: score(predicted[k], actual[k]) for k in ks}


def score(predicted: Sequence[float], actual: Sequence[float]) -> dict[str, float]:
    """The scores of one checkpoint (see the module docstring)."""
    n = len(actual)
    if n != len(predicted):
        raise ValueError(f"{len(predicted)} predictions for {n} actual totals")
    if n == 0:
        return {"recall_top20": 0.0, "spearman": 0.0, "mape": 0.0, "n": 0}
    m = (n + 4) // 5
    p_top = _top_membership(predicted, m)
    a_top = _top_membership(actual, m)
    recall = sum(p * a for p, a in zip(p_top, a_top, strict=True)) / m
    mape = sum(abs(p - a) / max(a, 1.0) for p, a in zip(predicted, actual, strict=True)) / n
    return {
        "recall_top20": recall,
        "spearman": _pearson(_average_ranks(predicted), _average_ranks(actual)),
        "mape": mape,
        "n": n,
    }


def _top_membership(values: Sequence[float], m: int) -> list[float]:
    """Probability that each value is among the top m under random tie-breaking."""
    threshold = sorted(values, reverse=True)[m - 1]
    above = sum(1 for v in values if v > threshold)
    tied = sum(1 for v in values if v == threshold)
    share = (m - above) / tied
    return [1.0 if v > threshold else share if v == threshold else 0.0 for v in values]


def _average_ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        mid = (start + end) / 2.0
        for j in range(start, end + 1):
            ranks[order[j]] = mid
        start = end + 1
    return ranks


def _pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 0.0 or syy <= 0.0:
        return 0.0
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return sxy / math.sqrt(sxx * syy)

"""Cutting a trajectory at a version boundary (a continuous job's `StaleChoice.CUT`).

`cut_record` keeps a finished trajectory's token ids exactly as they were sampled
and makes the tokens sampled by policy versions older than the bound context: loss
mask 0 (and logprob 0.0, the record's rule for mask-0 tokens). The tokens of the
versions still in the bound train, conditioned on that context as they were when
sampled, so nothing is re-tokenised and every later token's logprob stays the one
its engine recorded. What it cannot make exact: the trajectory's reward was earned
by all its tokens, the cut ones too, so a trainer gives the kept tokens a credit
partly earned under older weights (as partial rollouts do). Turns keep their
versions, so the record's `policy_span` still names every version that sampled it.
"""

from __future__ import annotations

from treadle.store.record import dumps_record, loads_record, trajectory_to_record


def cut_record(record_json: str, min_fresh: int) -> str | None:
    """The record with every sampled token of a version below `min_fresh` masked
    out; None if it has no token segments (a replay) or nothing sampled at or
    above `min_fresh` would be left to train (it must be run again instead)."""
    t = loads_record(record_json)
    kept = 0
    for seg in t.segments:
        for i, (m, v) in enumerate(zip(seg.loss_mask, seg.policy_versions, strict=True)):
            if m and v < min_fresh:
                seg.loss_mask[i] = 0
                seg.logprobs[i] = 0.0
            elif m:
                kept += 1
    if not kept:
        return None
    return dumps_record(trajectory_to_record(t))

"""The record's reward vector (v5): `rewards` and `judgements`, written and read.

    rewards          object   dimension -> number or null: a rubric's values (verified
                              parts as measured, judged parts in [0, 1]); null where a
                              judge gave no verdict; {} without a rubric
    judgements       array    one object per judged dimension:
        dimension        string   its name (a key of rewards, whose value is its value)
        status           string   judged | failed | skipped (`JudgementStatus`)
        value            number?  the verdict in [0, 1]; set exactly when judged
        score            number?  the verdict on the judge's scale; likewise
        reason           string   the judge's reason, or why there is no value
        optional         bool     the rubric trains without it
        judge            string   the judge's lane and model
        attempts         int      calls made (0: cached or skipped)
        cached           bool     answered from the cache
        prompt           string   what the judge was shown
        reply            string   its last reply
        reply_ids        [int]    the reply's ids (token-level lanes; else [])
        reply_logprobs   [number] one per reply id

A record with a required judged dimension that failed (`Trajectory.flagged`) has no
reward.
"""

from __future__ import annotations

from typing import Any

from treadle.store.errors import RecordError
from treadle.store.fields import Fields, as_number, float_list, int_list
from treadle.types import Judgement, JudgementStatus, RewardSource, Trajectory

_JUDGEMENT_KEYS = frozenset({"dimension", "status", "value", "score", "reason", "optional",
                             "judge", "attempts", "cached", "prompt", "reply", "reply_ids",
                             "reply_logprobs"})


def rewards_to_record(t: Trajectory) -> dict[str, Any]:
    """The two fields of `t`'s record; RecordError if they break an invariant."""
    check_rewards(t)
    return {
        "rewards": dict(t.rewards),
        "judgements": [{
            "dimension": j.dimension, "status": j.status.value, "value": j.value,
            "score": j.score, "reason": j.reason, "optional": j.optional, "judge": j.judge,
            "attempts": j.attempts, "cached": j.cached, "prompt": j.prompt,
            "reply": j.reply, "reply_ids": list(j.reply_ids),
            "reply_logprobs": list(j.reply_logprobs),
        } for j in t.judgements],
    }


def rewards_from_record(r: Fields, t: Trajectory) -> None:
    """Read the two fields into `t` (checked as `check_rewards` does)."""
    value = r.value("rewards")
    if not isinstance(value, dict):
        raise RecordError("rewards: must be a JSON object of numbers or nulls")
    t.rewards = {str(k): None if v is None else as_number(v, f"rewards.{k}")
                 for k, v in value.items()}
    t.judgements = [_judgement(item, f"judgements[{i}]")
                    for i, item in enumerate(r.array("judgements"))]
    check_rewards(t)


def _judgement(value: Any, path: str) -> Judgement:
    r = Fields(value, path, _JUDGEMENT_KEYS)
    j = Judgement(
        dimension=r.text("dimension", non_empty=True),
        status=r.choice("status", JudgementStatus), value=r.opt_number("value"),
        score=r.opt_number("score"), reason=r.text("reason"), optional=r.boolean("optional"),
        judge=r.text("judge"), attempts=r.integer("attempts"), cached=r.boolean("cached"),
        prompt=r.text("prompt"), reply=r.text("reply"),
        reply_ids=int_list(r.value("reply_ids"), f"{path}.reply_ids"),
        reply_logprobs=float_list(r.value("reply_logprobs"), f"{path}.reply_logprobs"))
    if len(j.reply_logprobs) not in (0, len(j.reply_ids)):
        raise RecordError(f"{path}.reply_logprobs: {len(j.reply_logprobs)} values for "
                          f"{len(j.reply_ids)} reply ids")
    return j


def check_rewards(t: Trajectory) -> None:
    """The invariants of the reward vector (module docstring)."""
    seen: set[str] = set()
    for i, j in enumerate(t.judgements):
        path = f"judgements[{i}]"
        judged = j.status is JudgementStatus.JUDGED
        if judged != (j.value is not None) or judged != (j.score is not None):
            raise RecordError(f"{path}: value and score must be set exactly when status is "
                              f"'judged' (status {j.status.value!r})")
        if j.dimension in seen:
            raise RecordError(f"{path}.dimension: {j.dimension!r:.80} is judged twice")
        seen.add(j.dimension)
        if j.dimension not in t.rewards or t.rewards[j.dimension] != j.value:
            raise RecordError(f"rewards.{j.dimension}: must be the judgement's value "
                              f"({j.value})")
    if t.reward_source is RewardSource.RUBRIC and not t.rewards:
        raise RecordError("reward_source: 'rubric' without a reward vector (rewards)")
    if t.flagged and t.reward is not None:
        raise RecordError("reward: must be null while a required judged dimension has no "
                          "verdict (the trajectory is flagged)")

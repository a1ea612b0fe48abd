"""Rubric rewards: named dimensions, verified by the suite or judged by a model.

`rubric` is the spec (dimensions, weights, gates, the judge's prompt templates) and
its aggregate; `verdict` reads a judge's reply (a score from its JSON, or the
expected score from the top logprobs of the score token); `judging` asks a judge
for each judged dimension of a trajectory through a `JudgeLane` (retries within a
budget, a cache by content hash) and fills the trajectory's reward vector. A
failed judgement is a dimension without a value and a reason, never a number.
"""

from treadle.rewards.errors import JudgeCallError, JudgeError, VerdictError
from treadle.rewards.judging import AgentJudgeLane, JudgeCache, JudgeLane, JudgeReply, Judges
from treadle.rewards.rubric import (
    AgentSpec,
    JudgedDimension,
    JudgeInput,
    Rubric,
    Scale,
    VerdictKind,
    VerifiedDimension,
    aggregate,
)
from treadle.rewards.verdict import expected_score, parse_json_verdict

__all__ = ["AgentJudgeLane", "AgentSpec", "JudgeCache", "JudgeCallError", "JudgeError",
           "JudgeInput", "JudgeLane", "JudgeReply", "JudgedDimension", "Judges", "Rubric",
           "Scale", "VerdictError", "VerdictKind", "VerifiedDimension", "aggregate",
           "expected_score", "parse_json_verdict"]

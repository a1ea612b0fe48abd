"""A job's rubric on the wire: what is wrong with it is a validation error naming
the field, before anything runs; a good one becomes the rubric's dataclasses."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from pydantic import ValidationError

from treadle.rewards import AgentSpec, Scale, VerdictKind
from treadle.rewards.rubric import JUDGE_TOOLS
from treadle.service.rubric_schemas import JudgeTool
from treadle.service.schemas import JobRequest

SUITE = {"suite": "math", "count": 2}
JUDGED = {"name": "clarity", "weight": 0.5, "template": "Rate $answer from $low to $high"}


def job(rubric: dict[str, Any], tasks: dict[str, Any] | None = None) -> JobRequest:
    return JobRequest.model_validate({"tasks": tasks or SUITE, "rubric": rubric})


def test_a_rubric_becomes_its_dataclasses() -> None:
    request = job({"verified": [{"name": "correct", "weight": 0.5, "gate": 1.0}],
                   "judged": [{**JUDGED, "scale": [0, 9], "verdict": "logprobs"}],
                   "judge": {"url": "http://judge:8000/v1"}})
    assert request.rubric is not None
    rubric = request.rubric.rubric()
    assert rubric.verified[0].gate == 1.0
    assert rubric.judged[0].scale == Scale(0, 9)
    assert rubric.judged[0].verdict is VerdictKind.LOGPROBS


@pytest.mark.parametrize(("rubric", "tasks", "says"), [
    ({"judged": [{**JUDGED, "template": "see $secret"}]}, None, r"\$secret"),
    ({"judged": [JUDGED, JUDGED]}, None, "unique"),
    ({}, None, "at least one dimension"),
    ({"judged": [{**JUDGED, "scale": [5, 1]}]}, None, "high"),
    ({"judged": [{**JUDGED, "verdict": "logprobs"}]}, None, "needs judge.url"),
    ({"judged": [{**JUDGED, "weight": -1}]}, None, "greater than or equal"),
    ({"judged": [JUDGED]}, {"workload": "math", "trajectories": 4}, "suite tasks"),
    ({"judged": [{**JUDGED, "agent": {}}], "judge": {"url": "http://j/v1"}}, None,
     "runs on the engines"),
    ({"judged": [{**JUDGED, "agent": {"tools": ["rm"]}}]}, None, "tools"),
    ({"judged": [{**JUDGED, "agent": {"tools": ["bash", "bash"]}}]}, None, "unique"),
    ({"judged": [{**JUDGED, "agent": {"max_turns": 0}}]}, None, "max_turns"),
])
def test_a_bad_rubric_is_refused_naming_what_is_wrong(rubric: dict[str, Any],
                                                     tasks: dict[str, Any] | None,
                                                     says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        job(rubric, tasks)


def test_an_agentic_dimension_becomes_its_spec() -> None:
    request = job({"judged": [{**JUDGED, "agent": {"tools": ["bash", "python"],
                                                   "max_turns": 4}}]})
    assert request.rubric is not None
    rubric = request.rubric.rubric()
    assert rubric.judged[0].agent == AgentSpec(("bash", "python"), max_turns=4)
    assert rubric.needs_work_tree  # the agent works in a copy of it
    # The wire's tool names are the rubric's.
    assert typing.get_args(JudgeTool) == JUDGE_TOOLS

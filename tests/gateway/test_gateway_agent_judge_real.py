"""An agentic judge on REAL vLLM (the CPU build, the shared `served` engine serving the
small trained model) in a REAL bwrap sandbox: a service with sandboxes in front of the
same vLLM runs a math job whose rubric has a dimension judged by an agent with the
python tool.

What is checked is the plumbing, not the verdict's quality (the model was trained to
solve arithmetic, not to judge): the judge's turns went to vLLM as the scheduler's
judge class, each prompt exactly the episode so far (never re-tokenized), a tool's
result shown between them, the judgement keeping the tokens vLLM sampled bit for
bit; and the dimension is a verdict on the scale or None with its reason, the
trajectory then flagged and unscored — never 0."""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest

from gateway.gateway_real import TOKEN, Served, sandboxed_service
from treadle.client import RolloutClient
from treadle.core.scheduler import JUDGE_RANK
from treadle.engines.base import GenerateRequest, GenerateResult
from treadle.types import JudgementStatus, TrajectoryStatus
from vllm_server import RecordingEngine

pytestmark = [pytest.mark.integration]
TEMPLATE = ("Task: $task\nAnswer: $answer\nCheck the answer with python, then submit your "
            "verdict on its $dimension from $low to $high as JSON: "
            "{\"score\": n, \"reason\": \"...\"}")


def test_an_agentic_judge_runs_on_vllm_as_the_judge_class_in_a_sandbox(
        served: Served, trained_checkpoint: Path) -> None:
    with sandboxed_service(served, trained_checkpoint) as (url, engine):
        created = httpx.post(f"{url}/v1/jobs", headers={"authorization": f"Bearer {TOKEN}"},
                             json={"tasks": {"suite": "math", "count": 1, "seed": 7,
                                             "options": {"python_tool": False}},
                                   "samples_per_task": 1,
                                   "limits": {"max_turns": 2, "max_tokens_per_turn": 48,
                                              "max_total_tokens": 1024},
                                   "sampling": {"temperature": 1.0, "seed": 3},
                                   "rubric": {"verified": [{"name": "correct", "weight": 0.5}],
                                              "judged": [{"name": "checked", "weight": 0.5,
                                                          "template": TEMPLATE,
                                                          "agent": {"tools": ["python"],
                                                                    "max_turns": 3,
                                                                    "max_total_tokens": 1024}}],
                                              "judge": {"attempts": 1, "max_tokens": 160,
                                                        "temperature": 1.0,
                                                        "timeout_s": 600}},
                                   "job_id": "agent-judge-real"})  # its seeds: the ids
        assert created.status_code == 201, created.text
        with RolloutClient(url, token=TOKEN) as client:
            (traj,) = [d.trajectory for d in client.trajectories(created.json()["job_id"],
                                                                 follow=True)]
    assert traj.status is not TrajectoryStatus.ERROR, traj.reason
    (j,) = traj.judgements
    calls = judge_calls(engine, f"{traj.trajectory_id}/judge/checked/0")
    assert calls, "the judge made no engine call"
    # The judge class, and each call's prompt the episode so far, token for token.
    assert all(req.priority == min(2**31 - 1, round(JUDGE_RANK)) for req, _ in calls)
    for (req, res), (after, _) in itertools.pairwise(calls):
        assert after.prompt_ids[:len(req.prompt_ids) + len(res.output_ids)] == \
            req.prompt_ids + res.output_ids
    # A tool's result is shown to the judge between its turns (the small model rarely
    # writes a well-formed call: the scripted test in tests/service shows a sure one).
    assert ("<tool_response>" in j.reply) == (len(calls) > 1), j.reply
    # The judge's own tokens, kept bit for bit.
    assert j.reply_ids == [i for _, res in calls for i in res.output_ids]
    assert j.reply_logprobs == [lp for _, res in calls for lp in res.logprobs]
    if j.status is JudgementStatus.JUDGED:
        assert j.score is not None and 1 <= j.score <= 5
        assert j.value == pytest.approx((j.score - 1) / 4) and traj.reward is not None
    else:  # no verdict: None with the reason, flagged, unscored — never 0
        assert j.status is JudgementStatus.FAILED and j.value is None, j
        assert j.reason.startswith("judge failed: attempt 1: ")
        assert traj.rewards["checked"] is None and traj.flagged and traj.reward is None
    print(f"agentic judge on vLLM: {len(calls)} turns, {j.status.value}: {j.reason[:160]!r}")


def judge_calls(engine: RecordingEngine, call_id: str
                ) -> list[tuple[GenerateRequest, GenerateResult]]:
    """The judge episode's engine calls in order (request ids ``<id>:<turn>:<n>``)."""
    mine = [(req, res) for req, res in engine.calls
            if req.request_id.rsplit(":", 2)[0] == call_id]
    return sorted(mine, key=lambda c: tuple(int(x) for x in
                                            c[0].request_id.rsplit(":", 2)[1:]))

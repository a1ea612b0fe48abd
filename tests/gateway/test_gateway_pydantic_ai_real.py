"""Pydantic AI (`pydantic-ai-slim[openai]`, pinned in pyproject's dev extra) through the
gateway, on REAL vLLM (CPU build) serving the small trained model, unchanged but for
its base URL: a tool-calling agent on math tasks, and its two structured-output
modes — `NativeOutput` (``response_format: json_schema``) and `PromptedOutput`
(``json_object``: what it sends for any model it does not know). What it sends must
be served (a 4xx fails the test), every trajectory is token-exact (the context
stored is what vLLM was sent, the sampled ids and logprobs are vLLM's), and a
structured call's reply is decoded by vLLM under the format: valid JSON (of the
schema, for json_schema) with one logprob per id, and its turn records how it was
constrained."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent, NativeOutput, PromptedOutput, Tool, ToolOutput
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits
from tokenizers import Tokenizer

from gateway.gateway_real import TOKEN, Served, assert_token_exact
from gateway.test_gateway_harnesses_real import assert_observed_at_mask_0, calls_of
from treadle.examples.math_harness import run_python
from treadle.train.transcripts import heldout_tasks, math_suite
from treadle.types import ConstraintKind, Task, Trajectory

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SETTINGS = {"max_tokens": 200}  # a reply fits the session's max_tokens_per_turn


@pytest.fixture(scope="module")
def tokenizer(trained_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_file(str(trained_checkpoint / "tokenizer.json"))


async def _run(base_url: str, prompt: str, output_type: Any, tools: list[Tool[None]],
               requests: int) -> Any:
    async with AsyncOpenAI(base_url=base_url, api_key=TOKEN,
                           max_retries=0) as client:  # closed in the run's own loop
        model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))
        agent: Agent[None, Any] = Agent(model, output_type=output_type, tools=tools,
                                        model_settings=SETTINGS)
        result = await agent.run(prompt, usage_limits=UsageLimits(request_limit=requests))
        return result.output


def _engine_calls(served: Served, traj: Trajectory) -> list[Any]:
    return [(req, res) for req, res in served.engine.calls
            if req.request_id.rsplit(":", 2)[0] == traj.trajectory_id]


# --- A tool-calling agent -------------------------------------------------------


def _math_tools(task: Task, fed_back: Callable[[str], str]) -> tuple[list[Tool[None]], Any]:
    """The suite's `python` tool as Pydantic AI sends a tool of a given schema, and
    `submit_answer` as its output tool (the run ends when the model calls it)."""
    specs = {t.spec["function"]["name"]: t.spec["function"] for t in math_suite().tools(task)}

    def python(code: str) -> str:
        return fed_back(run_python(code))

    def submit_answer(answer: str) -> str:
        return answer

    spec = specs["python"]
    tools = [Tool.from_schema(python, name="python", description=spec["description"],
                              json_schema=spec["parameters"])]
    output = [ToolOutput(submit_answer, name="submit_answer",
                         description=specs["submit_answer"]["description"]), str]
    return tools, output


def test_pydantic_ai_drives_token_exact_math_sessions(served: Served,
                                                      tokenizer: Tokenizer) -> None:
    job = f"pydantic-ai-{uuid.uuid4().hex[:8]}"
    created = served.http.post("/v1/jobs", json={"tasks": {"sessions": 4}, "job_id": job})
    assert created.status_code in (200, 201), created.text
    observed: dict[str, list[tuple[int, str]]] = {}
    rewards: dict[str, float] = {}
    for k, task in enumerate(heldout_tasks(4)):
        info = served.session(job_id=job, sampling={"seed": k})  # reproducible draws
        trajectory_id = info["trajectory_id"]
        outputs = observed.setdefault(trajectory_id, [])

        def fed_back(output: str, trajectory_id: str = trajectory_id,
                     outputs: list[tuple[int, str]] = outputs) -> str:
            outputs.append((calls_of(served, trajectory_id), output))
            return output

        tools, output_type = _math_tools(task, fed_back)
        status = "completed"
        try:
            answer = asyncio.run(_run(info["base_url"], str(task.prompt), output_type, tools,
                                      requests=4))
        except UsageLimitExceeded:
            answer, status = None, "max_turns"
        except UnexpectedModelBehavior:  # replies it could not use, after its retry
            answer = None
        rewards[trajectory_id] = float(str(answer).strip() == task.metadata["answer"])
        served.end(info, reward=rewards[trajectory_id], status=status)
    got = {t.trajectory_id: t for t in served.trajectories(job)}
    assert set(got) == set(rewards)
    calls, checked = [], 0
    for trajectory_id, traj in got.items():
        assert traj.reward == rewards[trajectory_id]
        n = assert_token_exact(traj, served.engine)
        assert n == len(traj.turns) >= 1
        checked += assert_observed_at_mask_0(traj, tokenizer, observed[trajectory_id], n)
        calls.append(n)
    # The model runs a program, reads its output, then goes on (once in four at least).
    assert max(calls) >= 2 and checked >= 1, (calls, rewards, [
        [(g.start_turn, g.start_reason) for g in t.segments] for t in got.values()])


# --- Structured output ----------------------------------------------------------


class Answer(BaseModel):
    """Bounded values (an enum): the small model never learnt JSON, and a value it may
    extend without end (an integer, a string) it does extend to its token budget."""

    answer: Literal["yes", "no"]


@pytest.mark.parametrize(("mode", "kind"), [("native", ConstraintKind.JSON_SCHEMA),
                                            ("prompted", ConstraintKind.JSON_OBJECT)])
def test_pydantic_ai_structured_output_is_decoded_under_its_format(
        served: Served, tokenizer: Tokenizer, mode: str, kind: ConstraintKind) -> None:
    info = served.session()
    output_type = NativeOutput(Answer) if mode == "native" else PromptedOutput(Answer)
    try:
        result = asyncio.run(_run(info["base_url"], "Is 6 * 7 = 42? Answer yes or no.",
                                  output_type, [], requests=3))
    except (UnexpectedModelBehavior, UsageLimitExceeded):  # JSON of another shape, twice
        assert mode == "prompted"  # (json_object: any object; json_schema: the schema's)
        result = None
    served.end(info, reward=float(isinstance(result, Answer) and result.answer == "yes"))
    (traj,) = served.trajectories(info["job_id"])
    n = assert_token_exact(traj, served.engine)
    assert n == len(traj.turns) >= 1
    for turn, (request, reply) in zip(traj.turns, _engine_calls(served, traj), strict=True):
        # vLLM was asked to decode under the format, and the turn says so.
        assert request.constraint is not None and request.constraint.kind is kind
        assert turn.constraint == request.constraint
        assert len(reply.logprobs) == len(reply.output_ids) >= 1
        text = tokenizer.decode(reply.output_ids[:-1] if reply.finish_reason == "stop"
                                else reply.output_ids)
        if kind is ConstraintKind.JSON_SCHEMA:
            assert reply.finish_reason == "stop"
            Answer.model_validate_json(text)  # the schema's: decoded under it
        elif reply.finish_reason == "stop":  # any object: the small model may not close one
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
    if mode == "native":
        assert isinstance(result, Answer)

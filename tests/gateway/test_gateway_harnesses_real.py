"""Real harness packages from PyPI through the gateway, on REAL vLLM (CPU build)
serving the small trained model: the OpenAI Agents SDK (its Chat Completions model)
and mini-swe-agent (litellm, commands in bubblewrap). Each harness runs unchanged
against a session's ``base_url``; what it sends must be served (no 4xx), and every
trajectory recorded must be token-exact — the context stored is what vLLM was sent
on every call, the sampled ids and logprobs are vLLM's bit for bit, and what the
harness fed back (tool outputs, format errors) is in the record at mask 0."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agents import (
    Agent,
    FunctionTool,
    OpenAIChatCompletionsModel,
    Runner,
    RunResult,
    StopAtTools,
    Tool,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI
from tokenizers import Tokenizer

from gateway.gateway_real import TOKEN, Served, assert_token_exact
from treadle.examples.math_harness import run_python
from treadle.train.transcripts import heldout_tasks, math_suite
from treadle.types import Task, Trajectory

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def tokenizer(trained_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_file(str(trained_checkpoint / "tokenizer.json"))


def calls_of(served: Served, trajectory_id: str) -> int:
    """The engine calls made so far for one trajectory."""
    return sum(req.request_id.rsplit(":", 2)[0] == trajectory_id
               for req, _ in served.engine.calls)


def new_context(traj: Trajectory, tokenizer: Tokenizer) -> list[str]:
    """Per call, in order: the text of the context it was sent that no earlier reply
    of the record precedes at mask 1 — what the harness added since the previous
    reply in the same segment (its observations), or a new segment's whole prompt.
    All of it is mask 0 or a prompt: never trained on."""
    out: list[str] = []
    for seg in traj.segments:
        ids, mask = seg.response_ids, seg.loss_mask
        before: list[int] = list(seg.prompt_ids)  # mask-0 tokens since the last reply
        pos = 0
        while pos < len(ids):
            if mask[pos] == 0:
                before.append(ids[pos])
                pos += 1
                continue
            out.append(tokenizer.decode(before, skip_special_tokens=False))
            before = []
            while pos < len(ids) and mask[pos] == 1:
                pos += 1
    return out


def assert_observed_at_mask_0(traj: Trajectory, tokenizer: Tokenizer,
                              observations: list[tuple[int, str]], calls: int) -> int:
    """Each (k, text) the harness fed back after the trajectory's k-th reply — and so
    sent with its (k+1)-th call, when there was one — is in that call's new context
    (`new_context`); returns how many were checked."""
    added = new_context(traj, tokenizer)
    assert len(added) == calls
    checked = 0
    for k, text in observations:
        if k < calls:
            assert text in added[k], (k, text, added[k])
            checked += 1
    return checked


# --- The OpenAI Agents SDK -----------------------------------------------------


def _answer(final_output: Any) -> str | None:
    """What a run answered: the submitted answer (StopAtTools makes it the final
    output), else a final reply's last \\boxed{...}, as the task's prompt allows."""
    text = str(final_output or "")
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return boxed[-1].strip() if boxed else text.strip() or None


def _agents_tools(specs: str, task: Task, fed_back: Callable[[str], str]) -> list[Tool]:
    """The agent's `python` and `submit_answer` tools, as the SDK sends them:

    - ``sdk``: `function_tool` over the Python functions — the SDK's own schema
      (titles, ``additionalProperties``, ``"strict": true``), the suite's descriptions;
    - ``suite``: `FunctionTool`s with the suite's schemas (what the model was trained
      on; the SDK still adds ``"strict": false``)."""
    desc = {t.spec["function"]["name"]: t.spec["function"]["description"]
            for t in math_suite().tools(task)}

    def python(code: str) -> str:
        return fed_back(run_python(code))

    def submit_answer(answer: str) -> str:
        return answer

    if specs == "sdk":
        def failed(_: Any, error: Exception) -> str:  # e.g. arguments that do not parse
            return fed_back(f"error: {error}")

        return [function_tool(f, description_override=desc[f.__name__],
                              failure_error_function=failed) for f in (python, submit_answer)]

    def tool(spec: dict[str, Any], run: Callable[[str], str], arg: str) -> FunctionTool:
        async def invoke(_: Any, arguments: str) -> str:
            try:
                value = json.loads(arguments or "{}").get(arg)
            except (json.JSONDecodeError, AttributeError) as e:
                return fed_back(f"error: {e}")
            return await asyncio.to_thread(run, str(value or ""))

        fn = spec["function"]
        return FunctionTool(name=fn["name"], description=fn["description"],
                            params_json_schema=fn["parameters"], on_invoke_tool=invoke,
                            strict_json_schema=False)

    by_name = {t.spec["function"]["name"]: t.spec for t in math_suite().tools(task)}
    return [tool(by_name["python"], python, "code"),
            tool(by_name["submit_answer"], submit_answer, "answer")]


async def _run_agent(base_url: str, tools: list[Tool], prompt: str) -> RunResult:
    async with AsyncOpenAI(base_url=base_url, api_key=TOKEN,
                           max_retries=0) as client:  # closed in the run's own loop
        agent: Agent[None] = Agent(
            name="solver", tools=tools,
            # No instructions: no system message, the policy's default one.
            model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
            tool_use_behavior=StopAtTools(stop_at_tool_names=["submit_answer"]))
        return await Runner.run(agent, prompt, max_turns=4)


@pytest.mark.parametrize("specs", ["sdk", "suite"])
def test_the_agents_sdk_drives_token_exact_math_sessions(
        served: Served, tokenizer: Tokenizer, specs: str) -> None:
    set_tracing_disabled(True)  # no trace export to api.openai.com
    job = f"agents-sdk-{specs}-{uuid.uuid4().hex[:8]}"
    created = served.http.post("/v1/jobs", json={"tasks": {"sessions": 4}, "job_id": job})
    assert created.status_code in (200, 201), created.text
    observed: dict[str, list[tuple[int, str]]] = {}  # per trajectory: (calls, output)
    outcomes: dict[str, tuple[str, str | None, float]] = {}  # status, answer, reward
    for task in heldout_tasks(4):
        info = served.session(job_id=job)
        trajectory_id = info["trajectory_id"]
        outputs = observed.setdefault(trajectory_id, [])

        def fed_back(output: str, trajectory_id: str = trajectory_id,
                     outputs: list[tuple[int, str]] = outputs) -> str:
            outputs.append((calls_of(served, trajectory_id), output))
            return output

        try:
            result = asyncio.run(_run_agent(info["base_url"],
                                            _agents_tools(specs, task, fed_back), str(task.prompt)))
        except MaxTurnsExceeded:
            answer, status = None, "max_turns"
        else:
            answer, status = _answer(result.final_output), "completed"
        reward = float(answer == task.metadata["answer"])
        served.end(info, reward=reward, status=status)
        outcomes[trajectory_id] = (status, answer, reward)
    got = {t.trajectory_id: t for t in served.trajectories(job)}
    assert set(got) == set(outcomes)
    calls, checked = [], 0
    for trajectory_id, traj in got.items():
        assert traj.reward == outcomes[trajectory_id][2]
        assert len(traj.segments) == 1  # the SDK only ever appends
        n = assert_token_exact(traj, served.engine)
        assert n == len(traj.turns) >= 1
        checked += assert_observed_at_mask_0(traj, tokenizer, observed[trajectory_id], n)
        calls.append(n)
    if specs == "suite":
        # The model runs a program, reads its output, then goes on (once in four at
        # least). With the SDK's own schemas it seldom writes a well-formed call: the
        # small model knows its training prompt only.
        assert max(calls) >= 2 and checked >= 1, (calls, outcomes)


# --- mini-swe-agent ------------------------------------------------------------

MSWEA_TASK = "Create a file answer.txt containing the result of 6*7 and then submit."
# mini's own config but a shorter task message: its 3 KB guide (~700 tokens here)
# leaves a 1024-token model no room for three steps.
MSWEA_INSTANCE = """Please solve this task: {{task}}

You can execute bash commands with the `bash` tool; every response must include \
exactly one bash tool call. Each command runs in a new subshell in the task's \
directory. When you are done, submit by running `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` \
on its own."""


def test_mini_swe_agent_drives_a_token_exact_session(
        served: Served, tokenizer: Tokenizer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Read when mini-swe-agent and litellm are imported: no price-map fetch, no banner,
    # one try per call (a 400 fails at once, not after ten tries), no ~/.config.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mswea-config"))
    import litellm
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_path
    from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    monkeypatch.setattr(litellm, "suppress_debug_info", True)
    config = yaml.safe_load(get_config_path("mini").read_text())  # the bash-tool config
    info = served.session()
    model = LitellmModel(
        model_name="openai/policy",  # litellm's OpenAI-compatible provider, model "policy"
        # Short replies: mini's format-error message is ~280 tokens here, and three
        # steps must fit the model's 1024 (a full context is refused with a 400).
        model_kwargs={"api_base": info["base_url"], "api_key": TOKEN, "drop_params": True,
                      "max_tokens": 64},
        cost_tracking="ignore_errors",  # no price for "openai/policy"
        observation_template=config["model"]["observation_template"],
        format_error_template=config["model"]["format_error_template"])
    env = BubblewrapEnvironment(env=config["environment"]["env"], timeout=30)
    agent = DefaultAgent(model, env, system_template=config["agent"]["system_template"],
                         instance_template=MSWEA_INSTANCE, step_limit=3, cost_limit=0)
    try:
        # Any 4xx from the gateway is raised here (after its one try).
        result = agent.run(MSWEA_TASK)
    finally:
        env.cleanup()
    status = result["exit_status"]
    assert status in ("Submitted", "LimitsExceeded", "RepeatedFormatError"), result
    served.end(info, reward=float(status == "Submitted"),
               status="max_turns" if status == "LimitsExceeded" else "completed")
    (traj,) = served.trajectories(info["job_id"])
    assert traj.reward == float(status == "Submitted")
    n = assert_token_exact(traj, served.engine)
    # Every call mini-swe-agent made reached vLLM once: none was refused or retried.
    assert n == len(traj.turns) == agent.n_calls >= 1
    # What it fed back after each reply: the command's output (a tool message, as its
    # observation template renders it) or, for a reply without a tool call, a format
    # error (a user message) — mini then drops that reply from its history.
    observations: list[tuple[int, str]] = []
    dropped: list[int] = []  # the replies mini did not send back
    replies = 0
    for message in agent.messages[2:]:
        if message["role"] == "assistant":
            replies += 1
        elif message["role"] == "tool":
            observations.append((replies, message["content"]))
        elif message["role"] == "user":  # a format error stands for its reply
            replies += 1
            dropped.append(replies)
            observations.append((replies, message["content"]))
    assert replies == n
    assert {k for k, _ in observations if k < n} == set(range(1, n))  # after every reply
    assert assert_observed_at_mask_0(traj, tokenizer, observations, n) >= n - 1
    # A call after a dropped reply cannot extend the context: it begins a new segment
    # (a training sequence of its own); a call after a tool call extends it.
    assert [(s.start_turn, s.start_reason) for s in traj.segments] == [(0, "start")] + [
        (k, "reply_edited") for k in dropped if k < n]

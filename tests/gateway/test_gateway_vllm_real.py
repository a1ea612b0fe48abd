"""The gateway on REAL vLLM (CPU build) serving the small trained model, driven by
real harness packages from PyPI: every recorded trajectory must be token-exact —
the context stored is what vLLM was sent on every call, the sampled ids and
logprobs are vLLM's bit for bit, and every token the model did not sample has mask
0. Also: a harness that prunes its context (two segments, two training
sequences), and an orchestrator with frozen sub-agents (PARL)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.gateway_real import TOKEN, Served, assert_token_exact
from treadle.client.samples import training_sequences
from treadle.examples.math_harness import run_python
from treadle.train.transcripts import heldout_tasks, math_suite

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _math_conversation(client: openai.OpenAI, task_index: int, *, stream: bool = False,
                       ) -> int:
    """A tool loop written the way harnesses write it; returns the calls made."""
    task = heldout_tasks(task_index + 1)[task_index]
    tools = [t.spec for t in math_suite().tools(task)]
    messages: list[Any] = [{"role": "user", "content": task.prompt}]
    for call in range(4):
        if stream:
            chunks = list(client.chat.completions.create(
                model="policy", messages=messages, tools=tools, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [{"id": t.id, "type": "function", "function": {
                    "name": t.function.name, "arguments": t.function.arguments}}
                    for t in calls if t.function is not None]
        else:
            reply = client.chat.completions.create(model="policy", messages=messages,
                                                   tools=tools)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        wanted = message.get("tool_calls") or []
        if not wanted or any(t["function"]["name"] == "submit_answer" for t in wanted):
            return call + 1
        for t in wanted:
            code = json.loads(t["function"]["arguments"]).get("code", "")
            messages.append({"role": "tool", "tool_call_id": t["id"],
                             "content": run_python(str(code))})
    return 4


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "streaming"])
def test_the_openai_client_drives_token_exact_tool_conversations(
        served: Served, stream: bool) -> None:
    job = f"oa-{'s' if stream else 'n'}"
    served.http.post("/v1/jobs", json={"tasks": {"sessions": 4}, "job_id": job})
    multi = 0
    for i in range(4):
        info = served.session(job_id=job)
        client = openai.OpenAI(base_url=info["base_url"], api_key=TOKEN, max_retries=0)
        calls = _math_conversation(client, i, stream=stream)
        multi += calls >= 2
        served.end(info, reward=1.0)
    assert multi >= 2  # the model runs a program, reads its output, then answers
    checked = 0
    for traj in served.trajectories(job):
        assert len(traj.segments) == 1
        checked += assert_token_exact(traj, served.engine)
    assert checked >= 6


def test_a_pruned_context_is_two_segments_and_two_training_sequences(
        served: Served) -> None:
    info = served.session()
    client = openai.OpenAI(base_url=info["base_url"], api_key=TOKEN, max_retries=0)
    task = heldout_tasks(1)[0]
    tools = [t.spec for t in math_suite().tools(task)]

    def call(messages: list[Any]) -> dict[str, Any]:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message: dict[str, Any] = reply.choices[0].message.model_dump(exclude_none=True)
        return message

    messages: list[Any] = [{"role": "user", "content": task.prompt}]
    messages.append(call(messages))
    messages.append({"role": "user", "content": "A long tool output: " + "7 " * 60})
    messages.append(call(messages))
    # Context-1's move: the old output the model has read is replaced by a stub.
    messages[2] = {"role": "user", "content": "[older output pruned]"}
    messages.append({"role": "user", "content": "Go on."})
    call(messages)
    served.end(info, reward=0.5)
    (traj,) = served.trajectories(info["job_id"])
    assert [s.start_reason for s in traj.segments] == ["start", "messages_edited"]
    assert traj.segments[1].start_turn == 2 and len(traj.turns) == 3
    assert assert_token_exact(traj, served.engine) == 3
    batch = training_sequences([traj])
    assert [(s.segment_index, s.start_reason) for s in batch.sequences] == [
        (0, "start"), (1, "messages_edited")]


def test_an_orchestrator_with_frozen_sub_agents_trains_only_its_own_tokens(
        served: Served) -> None:
    parent = served.session(metadata={"role": "orchestrator"})
    orchestrator = openai.OpenAI(base_url=parent["base_url"], api_key=TOKEN, max_retries=0)
    _math_conversation(orchestrator, 0)
    children = []
    for k in range(2):
        child = served.session(parent_session_id=parent["session_id"], trainable=False)
        worker = openai.OpenAI(base_url=child["base_url"], api_key=TOKEN, max_retries=0)
        _math_conversation(worker, k + 1)
        served.end(child)  # no reward of its own: it takes the orchestrator's
        children.append(child)
    served.end(parent, reward=1.0)
    got = {t.trajectory_id: t for t in served.trajectories(parent["job_id"])}
    top = got[parent["trajectory_id"]]
    assert top.children == [c["trajectory_id"] for c in children]
    for c in children:
        sub = got[c["trajectory_id"]]
        assert sub.parent_id == parent["trajectory_id"] and not sub.trainable
        assert sub.reward == 1.0  # the parent's credit
        assert all(m == 0 for s in sub.segments for m in s.loss_mask)
        assert sub.segments[0].response_ids  # its tokens are recorded
    assert_token_exact(top, served.engine)
    batch = training_sequences(list(got.values()))
    assert {s.trajectory_id for s in batch.sequences} == {top.trajectory_id}
    assert {e.trajectory_id for e in batch.exclusions} == {c["trajectory_id"] for c in children}

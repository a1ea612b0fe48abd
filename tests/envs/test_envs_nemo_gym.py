"""The NeMo Gym adapter against `FakeNemoGymServer`, a test double on 127.0.0.1 that
speaks NeMo Gym's wire protocol (its module docstring cites the source it follows)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from envs_helpers import play, run
from nemo_gym_fakes import TOKEN_HEADER, FakeNemoGymServer, serving

from agent.agent_helpers import FakeScriptedRunner, build_tokenizer
from treadle.agent.chat import IM_END, Call, HermesFormat, prompt_messages
from treadle.agent.loop import run_agent
from treadle.agent.tokenizer import HFTokenizer
from treadle.client.samples import exclusion_reason
from treadle.envs import EnvConfigError, ResourcesServerError, TaskFormatError, get_suite
from treadle.envs.adapters.nemo_gym import MaskedSampleError, NemoGymSuite
from treadle.envs.base import open_episode
from treadle.types import FailureStage, GroupKey, TrajectoryStatus

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "push", "description": "Push a number onto the stack.",
     "parameters": {"type": "object", "properties": {"value": {"type": "integer"}},
                    "required": ["value"], "additionalProperties": False}, "strict": True},
    {"type": "function", "name": "total", "description": "Sum of the stack.",
     "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
]
SYSTEM = "You add numbers with the stack tools."


def row(target: int, row_id: str | int | None = None, initial: list[int] | None = None,
        tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A row as NeMo Gym's example data writes them: a developer message first."""
    out: dict[str, Any] = {
        "responses_create_params": {
            "input": [{"role": "developer", "content": SYSTEM},
                      {"role": "user", "content": f"Push numbers that add up to {target}."}],
            "tools": TOOLS if tools is None else tools},
        "target": target, "initial": initial or [], "verifier_metadata": {"note": "verbatim"}}
    if row_id is not None:
        out["id"] = row_id
    return out


@pytest.fixture
def server() -> Iterator[FakeNemoGymServer]:
    with serving(FakeNemoGymServer()) as srv:
        yield srv


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def one_task(suite: NemoGymSuite) -> Any:
    [task] = suite.tasks()
    return task


@pytest.mark.integration
def test_an_episode_in_the_resources_session_protocol(server: FakeNemoGymServer) -> None:
    suite = get_suite("nemo_gym", base_url=server.url,
                      rows=[row(7, "seven", initial=[1]), row(3)])
    assert [t.task_id for t in suite.tasks(seed=0)] == [t.task_id for t in suite.tasks(seed=0)]
    task = next(t for t in suite.tasks() if t.task_id == "seven")

    async def episode() -> None:
        good, results = await play(suite, task, None, [
            ("push", {"value": 2}), ("push", '{"value": 4}'), ("total", {}),
            ("push", {"value": "x"})], final_message="Done: 1 + 2 + 4.")
        assert [r.ok for r in results] == [True, True, True, False]
        assert json.loads(results[2].output) == {"total": 7}  # the seed's `initial` counts
        assert "must be integer" in (results[3].error or "")  # checked before any HTTP
        assert good.reward == 1.0 and good.metrics["pushes"] == 3.0
        bad, _ = await play(suite, task, None, [("push", {"value": 1})])
        assert bad.reward == 0.0

    run(episode())
    seeds, closes = server.seen("/seed_session"), server.seen("/close_session")
    assert len(seeds) == len(closes) == 2
    for seed, close in zip(seeds, closes, strict=True):
        assert set(seed.body) == {"resources_session_id", "episode_id", "task_id", "task_data"}
        sid, episode_id = seed.body["resources_session_id"], seed.body["episode_id"]
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", episode_id["rollout_id"])
        assert episode_id["attempt"] == 0
        assert seed.body["task_id"] == {"taskset": "treadle", "task_id": "seven"}
        assert seed.body["task_data"] == {"target": 7, "initial": [1],
                                          "verifier_metadata": {"note": "verbatim"}}
        assert close.body == {"resources_session_id": sid, "episode_id": episode_id}
    # Every call after the seed carries the session it made: the cookie names it.
    sids = [s.body["resources_session_id"] for s in seeds]
    assert len(set(sids)) == 2
    after_seed = [r for r in server.requests if r.path != "/seed_session"]
    assert {r.session for r in after_seed} == set(sids)
    first = [r.path for r in server.requests if r.session == sids[0]]
    assert first == ["/push", "/push", "/total", "/verify", "/close_session"]
    verify = server.seen("/verify")[0].body
    output = verify["response"]["output"]
    assert [o["type"] for o in output[:2]] == ["function_call", "function_call_output"]
    assert output[0]["name"] == "push" and json.loads(output[0]["arguments"]) == {"value": 2}
    assert output[-1]["content"][0]["text"] == "Done: 1 + 2 + 4."
    assert verify["target"] == 7 and "id" not in verify


@pytest.mark.integration
def test_the_legacy_protocol_seeds_with_the_row_and_still_closes(
        server: FakeNemoGymServer) -> None:
    suite = NemoGymSuite(server.url, rows=[row(5, initial=[5])], session_protocol="legacy")
    result, _ = run(play(suite, one_task(suite), None, [("total", {})]))
    assert result.reward == 1.0
    [seed], [close] = server.seen("/seed_session"), server.seen("/close_session")
    assert seed.body == one_task(suite).metadata and seed.session is None
    assert set(close.body) == {"resources_session_id", "episode_id"}
    cookies = {r.session for r in server.requests if r.path != "/seed_session"}
    assert len(cookies) == 1 and None not in cookies  # the seed's cookie, on every call


@pytest.mark.integration
def test_a_server_without_resources_sessions_fails_loudly(server: FakeNemoGymServer) -> None:
    server.legacy_only = True  # takes the seed as a row and answers without the echo
    suite = NemoGymSuite(server.url, rows=[row(1)])
    with pytest.raises(ResourcesServerError, match="session_protocol='legacy'"):
        run(play(suite, one_task(suite), None, []))
    assert len(server.seen("/close_session")) == 1  # what it did seed is released


@pytest.mark.integration
def test_a_masked_verify_raises_and_keeps_its_failure_fields(server: FakeNemoGymServer) -> None:
    suite = NemoGymSuite(server.url, rows=[row(2)])
    for mode, kind, reason in [("judge_failed", "judge_failed", "judge unavailable"),
                               ("legacy_judge_failed", "judge_failed", "judge unavailable")]:
        server.verify_mode = mode
        with pytest.raises(MaskedSampleError) as caught:
            run(play(suite, one_task(suite), None, [("push", {"value": 2})]))
        assert caught.value.failure_kind == kind
        assert reason in (caught.value.failure_reason or "")
        assert isinstance(caught.value, ResourcesServerError)  # an infrastructure failure
    assert len(server.seen("/close_session")) == 2  # closed although the score failed


@pytest.mark.integration
def test_a_masked_verify_is_an_excluded_trajectory_never_reward_0(
        server: FakeNemoGymServer, tok: HFTokenizer) -> None:
    server.verify_mode = "judge_failed"
    suite = NemoGymSuite(server.url, rows=[row(2, "two")])
    task = one_task(suite)
    fmt = HermesFormat()
    runner = FakeScriptedRunner(tok, [fmt.reply_text("", [Call.of("push", {"value": 2})]),
                                      "2" + IM_END])

    async def go() -> Any:
        async with open_episode(suite, task) as episode:
            return await run_agent(episode, tok, runner, traj_id="two/t0",
                                   key=GroupKey("two", 0))

    traj = run(go())
    assert traj.status is TrajectoryStatus.ERROR and traj.failure_stage is FailureStage.EVAL
    assert traj.reward is None and traj.infra_failure
    excluded = exclusion_reason(traj) or ""
    assert "MaskedSampleError" in excluded and "failure_kind='judge_failed'" in excluded
    assert "TimeoutError: judge unavailable" in excluded
    # The developer message was the prompt's system turn (not an error/runtime exclusion).
    prompt = tok.decode(runner.prompts[0])
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}")
    assert len(server.seen("/push")) == 1 and len(server.seen("/close_session")) == 1


@pytest.mark.integration
def test_a_degraded_but_valid_verify_keeps_its_reward_and_failure_fields(
        server: FakeNemoGymServer) -> None:
    server.verify_mode = "degraded"
    suite = NemoGymSuite(server.url, rows=[row(2)])
    result, _ = run(play(suite, one_task(suite), None, [("push", {"value": 2})]))
    assert result.reward == 1.0
    assert "failure_kind='tool_output_truncated'" in result.detail
    assert "the tool log was cut at 1 MiB" in result.detail


@pytest.mark.integration
def test_the_session_is_closed_once_when_the_episode_fails(
        server: FakeNemoGymServer, caplog: pytest.LogCaptureFixture) -> None:
    suite = NemoGymSuite(server.url, rows=[row(2)], timeout_s=5)
    server.verify_mode = "500"
    with pytest.raises(ResourcesServerError, match="HTTP 500"):
        run(play(suite, one_task(suite), None, [("push", {"value": 2})]))
    server.verify_mode, server.seed_status = "score", 503
    with pytest.raises(ResourcesServerError, match="seed_session answered HTTP 503"):
        run(play(suite, one_task(suite), None, []))
    seeds, closes = server.seen("/seed_session"), server.seen("/close_session")
    # Both closed, the unseeded one too: its id was assigned before the seed was sent.
    assert [c.body["resources_session_id"] for c in closes] == \
        [s.body["resources_session_id"] for s in seeds]
    dead = NemoGymSuite("http://127.0.0.1:9", rows=[row(2)], timeout_s=2)  # discard port
    with pytest.raises(ResourcesServerError, match="seed_session"):  # not the failed close
        run(play(dead, dead.tasks()[0], None, []))
    assert "/close_session of treadle-" in caplog.text  # which is logged instead


@pytest.mark.integration
def test_the_session_is_closed_once_when_the_episode_is_aborted(
        server: FakeNemoGymServer) -> None:
    suite = NemoGymSuite(server.url, rows=[row(2)])
    server.hold_tools = True

    async def go() -> None:
        episode = asyncio.create_task(play(suite, one_task(suite), None,
                                           [("push", {"value": 2})]))
        entered = await asyncio.to_thread(server.tool_entered.wait, 30)
        assert entered, "the tool call never reached the server"
        episode.cancel()  # the caller aborts the trajectory mid-tool
        with pytest.raises(asyncio.CancelledError):
            await episode
        server.release.set()  # lets the abandoned tool request finish

    run(go())
    [seed], [close] = server.seen("/seed_session"), server.seen("/close_session")
    assert close.body["resources_session_id"] == seed.body["resources_session_id"]


@pytest.mark.integration
def test_a_server_without_close_session_needs_no_close(server: FakeNemoGymServer) -> None:
    server.has_close_route = False  # servers before NeMo Gym's close answer 404
    suite = NemoGymSuite(server.url, rows=[row(2, initial=[2])], session_protocol="legacy")
    result, _ = run(play(suite, one_task(suite), None, []))
    assert result.reward == 1.0 and len(server.seen("/close_session")) == 1


@pytest.mark.integration
def test_mcp_tools_are_listed_and_called_with_the_session_token(
        server: FakeNemoGymServer) -> None:
    server.expose_mcp = True
    for protocol in ("resources_session", "legacy"):
        suite = NemoGymSuite(server.url, rows=[row(4, tools=[], initial=[1])],
                             session_protocol=protocol, mcp_tools=True)
        assert [t.name for t in suite.mcp_tools] == ["push", "total"]  # two pages
        task = one_task(suite)
        assert [t.name for t in suite.tools(task)] == ["push", "total"]
        result, results = run(play(suite, task, None, [
            ("push", {"value": 3}), ("push", {"value": "x"}), ("total", {})]))
        assert json.loads(results[0].output) == {"stack": [1, 3]}
        assert results[1].error is not None and "must be integer" in results[1].error
        assert json.loads(results[2].output) == {"total": 4} and result.reward == 1.0
    calls = [r for r in server.seen("/mcp") if r.body["method"] == "tools/call"]
    assert len(calls) == 4 and all(TOKEN_HEADER.lower() in c.headers for c in calls)
    assert all("text/event-stream" in c.headers["accept"] for c in server.seen("/mcp"))
    assert not server.seen("/push")  # MCP tools never go over the direct routes


@pytest.mark.integration
def test_a_tool_error_over_mcp_is_an_observation(server: FakeNemoGymServer) -> None:
    server.expose_mcp = True
    suite = NemoGymSuite(server.url, rows=[row(1, tools=[])], mcp_tools=True)
    loose = NemoGymSuite(server.url, rows=[row(1, tools=[])])
    loose.mcp_tools = [t.model_copy(update={"input_schema": {"type": "object"}})
                       for t in suite.mcp_tools]  # lets a bad argument reach the server
    _, [pushed] = run(play(loose, one_task(loose), None, [("push", {"value": "x"})]))
    assert pushed.error == "the tool server answered an MCP tool error"
    assert "HTTP 422: value must be an integer" in pushed.output


@pytest.mark.integration
def test_server_side_tool_errors_are_observations(server: FakeNemoGymServer) -> None:
    loose = [{**TOOLS[0], "parameters": {"type": "object", "properties": {}}}]
    suite = NemoGymSuite(server.url, rows=[row(1, tools=loose)])

    async def episode() -> None:
        _, results = await play(suite, one_task(suite), None,
                                [("push", {"value": "x"}), ("nope", {})])
        assert results[0].error == "the tool server answered HTTP 422", results[0]
        assert "value must be an integer" in results[0].output
        assert results[1].error is not None and "unknown tool 'nope'" in results[1].error

    run(episode())


def test_prompts_render_the_roles_of_nemo_gym_rows() -> None:
    suite = NemoGymSuite("http://127.0.0.1:1")
    task = suite.task_from_record(row(5))
    assert task.prompt == [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": "Push numbers that add up to 5."}]
    parts = {"responses_create_params": {"input": [
        {"type": "message", "role": "system", "content": "a"},
        {"role": "developer", "content": [{"type": "input_text", "text": "b"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "c"},
                                     {"type": "input_text", "text": "d"}]}]}}
    assert suite.task_from_record(parts).prompt == [
        {"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "c\nd"}]
    HermesFormat().prompt(prompt_messages(suite.task_from_record(parts).prompt), [])  # renders
    assert suite.task_from_record({"responses_create_params": {"input": "hi"}}).prompt == "hi"
    bad_inputs: list[Any] = [
        [{"role": "user", "content": "q"}, {"role": "developer", "content": "late"}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
        [{"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}],
        [{"role": "developer", "content": "only a system turn"}], []]
    for bad in bad_inputs:
        with pytest.raises(TaskFormatError, match=r"responses_create_params\.input"):
            suite.task_from_record({"responses_create_params": {"input": bad}})


def test_row_format_is_checked(tmp_path: Path) -> None:
    suite = NemoGymSuite("http://127.0.0.1:1")
    task = suite.task_from_record(row(5))
    assert task.task_id.startswith("nemo-") and suite.task_from_record(row(5)).task_id == \
        task.task_id
    assert suite.task_to_record(suite.task_from_record(row(5, "r"))) == row(5, "r")
    numbered = suite.task_from_record(row(5, 0))  # NeMo Gym's example rows number ids
    assert numbered.task_id == "0" and suite.task_to_record(numbered) == row(5, 0)
    bad: dict[str, Any]
    for bad in ({}, {"responses_create_params": {}},
                {"responses_create_params": {"input": 3}},
                {"responses_create_params": {"input": "x", "tools": [{"type": "function"}]}},
                {"responses_create_params": {"input": "x"}, "id": ""},
                {"responses_create_params": {"input": "x"}, "id": True}):
        with pytest.raises(TaskFormatError):
            suite.task_from_record(bad)
    with pytest.raises(EnvConfigError):
        NemoGymSuite("127.0.0.1:8000")
    with pytest.raises(EnvConfigError, match="base_url"):
        get_suite("nemo_gym")
    with pytest.raises(EnvConfigError, match="session_protocol"):
        NemoGymSuite("http://127.0.0.1:1", session_protocol="cookies")
    with pytest.raises(EnvConfigError, match="taskset"):
        NemoGymSuite("http://127.0.0.1:1", taskset="")
    with pytest.raises(EnvConfigError, match="mcp_tools"):
        NemoGymSuite("http://127.0.0.1:1", mcp_tools="yes")  # type: ignore[arg-type]
    with pytest.raises(ResourcesServerError, match="tools/list"):
        NemoGymSuite("http://127.0.0.1:9", mcp_tools=True, timeout_s=2)


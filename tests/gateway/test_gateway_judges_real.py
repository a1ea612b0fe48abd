"""Judges on REAL vLLM (the CPU build; the shared `served` service and engine): the
small model judges a math job through the policy's engines, as the scheduler's judge
class, and through vLLM's OpenAI endpoint; a judge endpoint that dies mid-job.

What is checked is the plumbing, not the verdicts' quality: the prompt is the
template filled exactly, the verdict decoded under its JSON schema and parsed, the
reward vector stored, streamed and exported (Parquet, verl), the logprob verdict the
expected score under vLLM's own top logprobs; a dead judge leaves dimensions None
with reasons, trajectories flagged and unscored, none scored 0, none lost."""

from __future__ import annotations

import contextlib
import http.server
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.gateway_real import Served
from treadle.agent.chat import chat_format
from treadle.agent.tokenizer import HFTokenizer
from treadle.client.verl import to_verl
from treadle.core.scheduler import JUDGE_RANK
from treadle.engines.vllm import VLLMEngine
from treadle.envs.registry import get_suite
from treadle.rewards.rubric import Scale
from treadle.rewards.verdict import verdict_schema
from treadle.store.export import read_parquet, write_parquet
from treadle.store.record import trajectory_to_record
from treadle.types import JsonSchemaConstraint, JudgementStatus, RewardSource, Trajectory

pytestmark = [pytest.mark.integration]
TEMPLATE = "Task: $task\nAnswer: $answer\nRate the $dimension from $low to $high as JSON."
LIMITS = {"max_turns": 2, "max_tokens_per_turn": 48, "max_total_tokens": 1024}


def submit(served: Served, job_id: str, judge: dict[str, Any], *, verdict: str = "json",
           count: int = 2) -> None:
    body = {"job_id": job_id, "tasks": {"suite": "math", "count": count, "seed": 7,
                                        "options": {"python_tool": False}},
            "samples_per_task": 2, "limits": LIMITS,
            "sampling": {"temperature": 1.0, "seed": 3},
            "rubric": {"verified": [{"name": "correct", "weight": 0.5}],
                       "judged": [{"name": "clarity", "weight": 0.5, "template": TEMPLATE,
                                   "verdict": verdict}],
                       "judge": {"max_tokens": 384, "attempts": 2, "timeout_s": 300, **judge}}}
    created = served.http.post("/v1/jobs", json=body)
    assert created.status_code == 201, created.text


def vllm(served: Served) -> VLLMEngine:
    engine = served.engine.inner
    assert isinstance(engine, VLLMEngine)
    return engine


def final_answer(served: Served, traj: Trajectory, tok: HFTokenizer) -> str:
    """The last reply vLLM sent for the trajectory, as the chat format reads it."""
    fmt = chat_format("hermes")
    calls = [(req, res) for req, res in served.engine.calls
             if req.request_id.rsplit(":", 2)[0] == traj.trajectory_id]
    last = max(calls, key=lambda c: int(c[0].request_id.rsplit(":", 2)[1]))[1]
    stop = tok.token_id(fmt.stop_token)
    return fmt.reply(tok.decode([i for i in last.output_ids if i != stop])).text


def test_the_policys_engines_judge_as_the_judge_class(served: Served, tmp_path: Path,
                                                      trained_checkpoint: Path) -> None:
    submit(served, "judge-policy", {})
    trajectories = served.trajectories("judge-policy")
    assert len(trajectories) == 4
    tok = HFTokenizer(trained_checkpoint)
    prompts = {t.task_id: str(t.prompt)
               for t in get_suite("math", python_tool=False).tasks(2, seed=7)}
    judge_calls = {req.request_id: (req, res) for req, res in served.engine.calls
                   if "/judge/" in req.request_id}
    for t in trajectories:
        assert t.status.terminal and t.reward is not None, t.reason
        (j,) = t.judgements
        assert j.status is JudgementStatus.JUDGED, j.reason
        assert j.prompt == (f"Task: {prompts[t.task_id]}\nAnswer: "
                            f"{final_answer(served, t, tok)}\nRate the clarity from 1 to 5 "
                            "as JSON.")
        # The reply is vLLM's, decoded under the verdict's schema, as the judge class.
        (req, res), = [c for rid, c in judge_calls.items()
                       if rid.startswith(f"{t.trajectory_id}/judge/clarity/")]
        assert req.constraint == JsonSchemaConstraint(verdict_schema(Scale(1, 5)), "verdict")
        assert req.priority == min(2**31 - 1, round(JUDGE_RANK))
        assert j.reply_ids == res.output_ids and j.reply_logprobs == res.logprobs
        verdict = json.loads(j.reply)
        assert j.score == verdict["score"] and j.reason == verdict["reason"]
        assert j.value == (j.score - 1) / 4
        assert t.rewards == {"correct": t.metrics["correct"], "clarity": j.value}
        assert t.reward == pytest.approx(0.5 * t.rewards["correct"] + 0.5 * j.value)
        assert t.reward_source is RewardSource.RUBRIC
    # Exported: Parquet carries the vector and reads back; verl gets it as extra info.
    path = tmp_path / "judged.parquet"
    write_parquet(((i + 1, trajectory_to_record(t)) for i, t in enumerate(trajectories)), path)
    assert [back for _, back in read_parquet(path)] == trajectories
    extra = [r["extra_fields"]["reward_extra_info"] for r in to_verl(trajectories).data]
    assert [e["clarity"] for e in extra] == [t.rewards["clarity"] for t in trajectories]


def test_an_endpoint_judges_by_the_expected_score_of_vllms_top_logprobs(served: Served) -> None:
    url, model = vllm(served).base_url + "/v1", vllm(served).model
    submit(served, "judge-logprobs", {"url": url, "model": model}, verdict="logprobs",
           count=1)
    trajectories = served.trajectories("judge-logprobs")
    assert len(trajectories) == 2
    for t in trajectories:
        (j,) = t.judgements
        assert j.status is JudgementStatus.JUDGED, j.reason
        # The same question again, to read vLLM's top logprobs at the score token.
        body = {"model": model, "max_tokens": 384, "temperature": 0.0,
                "messages": [{"role": "user", "content": j.prompt}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "verdict", "schema": verdict_schema(Scale(1, 5))}},
                "logprobs": True, "top_logprobs": 20}
        content = httpx.post(f"{url}/chat/completions", json=body,
                             timeout=300).json()["choices"][0]["logprobs"]["content"]
        at = next(c for c in content if c["token"].strip() in "12345" and c["token"].strip())
        probs: dict[int, float] = {}
        for alt in at["top_logprobs"]:
            if alt["token"].strip() in {"1", "2", "3", "4", "5"}:
                key = int(alt["token"].strip())
                probs[key] = probs.get(key, 0.0) + math.exp(alt["logprob"])
        expected = sum(k * p for k, p in probs.items()) / sum(probs.values())
        assert j.score == pytest.approx(expected, rel=1e-3)
        assert 1.0 <= j.score <= 5.0 and j.value == pytest.approx((j.score - 1) / 4)


class _DyingJudge(http.server.BaseHTTPRequestHandler):
    """Forwards `answers` chat calls to vLLM, then drops every connection (dead)."""

    upstream = ""
    answers = 2
    served = 0
    lock = threading.Lock()
    died = threading.Event()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        with self.lock:
            cls = type(self)
            alive = cls.served < cls.answers
            cls.served += 1
        if not alive:
            cls.died.set()
            self.close_connection = True
            return  # no answer: the connection closes under the caller
        reply = httpx.post(f"{self.upstream}{self.path[3:]}", content=body,
                           headers={"content-type": "application/json"}, timeout=300)
        self.send_response(reply.status_code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply.content)))
        self.end_headers()
        self.wfile.write(reply.content)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def dying_judge(upstream: str) -> Iterator[tuple[str, threading.Event]]:
    handler = type("Handler", (_DyingJudge,), {"upstream": upstream,
                                               "died": threading.Event(), "served": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler.died
    finally:
        server.shutdown()
        server.server_close()


def test_a_judge_that_dies_mid_job_leaves_dimensions_none_never_zero(served: Served) -> None:
    with dying_judge(vllm(served).base_url + "/v1") as (url, died):
        submit(served, "judge-dies", {"url": url, "model": vllm(served).model, "attempts": 2})
        trajectories = served.trajectories("judge-dies")
        assert died.is_set()
    assert len(trajectories) == 4  # none lost
    judged = [t for t in trajectories if t.judgements[0].status is JudgementStatus.JUDGED]
    dead = [t for t in trajectories if t not in judged]
    assert len(judged) == 2 and len(dead) == 2
    for t in dead:
        (j,) = t.judgements
        assert j.status is JudgementStatus.FAILED and j.value is None and j.attempts == 2
        assert "JudgeCallError" in j.reason and j.reason.count("attempt") == 2
        assert t.rewards["clarity"] is None and t.flagged
        assert t.reward is None and t.reward_source is None  # unscored: never 0
    for t in judged:
        assert t.reward is not None and not t.flagged
    converted = to_verl(trajectories)
    assert {e.trajectory_id for e in converted.exclusions} == {t.trajectory_id for t in dead}
    assert all(e.reason.startswith("unjudged: clarity: judge failed") for e in converted.exclusions)

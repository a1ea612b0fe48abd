"""A trainer's gateway session outlives a restart of the service: killed with SIGKILL
after two calls and started again on the same store, the service opens the session
again from its journal, so the harness's next call, with the same key, continues
the same context; the engine is asked for the new call only, and the delivered
record holds all three replies, token for token, saying where it resumed. On a
scripted engine (`FakeVLLMServer`, outside the service's process group), in a
`treadle serve` process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import until

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.bench.faults import ServiceProcess
from treadle.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "session-resume"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
REPLIES = ["one", "two", "three"]


def _chat(base_url: str, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(f"{base_url}/chat/completions", timeout=60,
                   headers={"authorization": f"Bearer {key}"},
                   json={"model": "policy", "messages": messages, "logprobs": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_session_continues_after_a_kill_9(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    end = tok.token_id("<|im_end|>")
    script = [[*tok.encode(text), end] for text in REPLIES]
    fake = FakeVLLMServer(script=list(script))
    with fake.serve() as engine_url:
        service = ServiceProcess(tmp_path / "s.db", tmp_path / "s.log", TOKEN, [
            "--engine", engine_url, "--served-model", "m", "--tokenizer", str(tmp_path / "tok"),
            "--policy", "verl"])
        service.start()
        try:
            made = httpx.post(f"{service.url}/v1/sessions", headers=ADMIN, json={}).json()
            messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
            for _ in range(2):
                reply = _chat(made["base_url"], made["api_key"], messages)
                messages += [{"role": "assistant",
                              "content": reply["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "go on"}]
            def journaled() -> bool:
                with Store(service.db) as store:
                    got = store.journaled(made["job_id"], made["trajectory_id"]).turns
                return len(got) == 2

            until(journaled, lambda: None, service.db, service.proc)
        finally:
            service.kill()
        service.start()
        try:
            # The harness knows nothing of the restart: same key, same conversation.
            third = _chat(made["base_url"], made["api_key"], messages)
            ended = httpx.post(f"{service.url}/v1/sessions/{made['session_id']}/end",
                               headers=ADMIN, json={"reward": 1.0})
            assert ended.status_code == 200, ended.text
            with httpx.stream("GET", f"{service.url}/v1/jobs/{made['job_id']}/trajectories",
                              headers=ADMIN, params={"follow": "true"}, timeout=60) as r:
                [line] = [json.loads(x) for x in r.iter_lines() if x]
        finally:
            service.stop()
    assert third["choices"][0]["message"]["content"] == "three"
    assert len(fake.requests) == 3  # the replayed calls asked the engine nothing
    record = line["trajectory"]
    assert (record["status"], record["reward"], record["attempt"]) == ("completed", 1.0, 1)
    assert [p["turn"] for p in record["resumed"]] == [2]
    assert [t["output_tokens"] for t in record["turns"]] == [len(ids) for ids in script]
    sampled = [i for s in record["segments"]
               for i, m in zip(s["response_ids"], s["loss_mask"], strict=True) if m]
    assert sampled == [i for ids in script for i in ids]
    # Every call's context was the one before it plus what the harness added.
    prompts = [body["prompt"] for body in fake.requests]
    assert prompts[1][:len(prompts[0])] == prompts[0]
    assert prompts[2][:len(prompts[1])] == prompts[1]

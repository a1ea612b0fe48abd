"""No answer to a client shows an engine's address: an engine's error names it (for
the logs), and every error body — the gateway's OpenAI-shaped ones and the API's
``{"detail"}`` — carries it as ``<engine>`` (`engines.errors.public_text`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.engines.errors import ENGINE_PLACEHOLDER, public_text, remember_address
from treadle.runtime.launcher import free_port
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration]
TOKEN = "addr-token"


def test_public_text_hides_each_form_of_a_remembered_address() -> None:
    remember_address("http://user:pw@10.9.8.7:8123/")
    said = ("http://10.9.8.7:8123 rejected the request; cannot connect to 10.9.8.7:8123; "
            "the schema is http://json-schema.org/draft-07/schema#")
    assert public_text(said) == (
        "<engine> rejected the request; cannot connect to <engine>; "
        "the schema is http://json-schema.org/draft-07/schema#")  # not an engine's
    # A short address (one a fuzzed registration gave) hides itself, nothing else.
    remember_address("http://0")
    assert public_text("no job 'no-such-job-0', got 0; http://0 or 0:80 refused") == (
        "no job 'no-such-job-0', got 0; <engine> or <engine> refused")


def _hidden(text: str, engine: str) -> None:
    netloc = urlsplit(engine).netloc
    assert engine not in text and netloc not in text, text
    assert ENGINE_PLACEHOLDER in text, text


@pytest.mark.parametrize(("mode", "status", "code"), [
    ("reject400", 400, "context_length_exceeded"),  # the engine refused the context
    ("error500", 503, "engine_error"),  # the engine failed
])
def test_a_gateway_error_from_the_engine_hides_its_address_and_logs_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, status: int,
        code: str) -> None:
    build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer()
    fake.mode = mode
    caplog.set_level(logging.WARNING)
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"),
                               # a failed engine's turn waits this long for one to come
                               # back before the call fails (60 s by default)
                               engine_wait_s=0.5)
        with running_service(config) as url, httpx.Client(
                base_url=url, headers={"authorization": f"Bearer {TOKEN}"},
                timeout=120) as http:
            info = http.post("/v1/sessions", json={}).json()
            answer = http.post(f"{info['base_url']}/chat/completions", json={
                "model": "policy", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == status, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["code"] == code
    _hidden(error["message"], engine)
    # The logs keep the address, with what the engine said.
    assert any(engine in r.getMessage() for r in caplog.records), caplog.text


def test_an_api_error_about_an_engine_hides_its_address(tmp_path: Path) -> None:
    config = ServiceConfig(db=str(tmp_path / "s.db"), token=TOKEN, policy="verl")
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing answers there
    with running_service(config) as url, httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
        answer = http.post("/v1/engines", json={"url": nowhere, "model": "m"})
    assert answer.status_code == 422, answer.text
    (entry,) = answer.json()["detail"]
    assert entry["loc"] == ["body", "url"]
    _hidden(entry["msg"], nowhere)

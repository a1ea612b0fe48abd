"""docs/gateway.md's example, executed as written against a running service (on a
scripted engine, so that the reply is known)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration]
DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def test_the_docs_example_runs_as_written(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (example, *_) = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"),
                               re.DOTALL)
    tok = build_tokenizer(tmp_path / "tok")
    fake = FakeVLLMServer(reply_ids=[*tok.encode("42"), tok.token_id("<|im_end|>")])
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), token="docs-token", policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"))
        with running_service(config) as url:
            monkeypatch.setenv("TREADLE_URL", url)
            monkeypatch.setenv("TREADLE_TOKEN", "docs-token")
            out = io.StringIO()
            scope: dict[str, Any] = {"__name__": "docs_example"}
            with contextlib.redirect_stdout(out):
                exec(compile(example, str(DOC), "exec"), scope)
    printed = out.getvalue().splitlines()
    assert printed[0] == "reply: 42"
    assert printed[1] == (f"prompt tokens: {len(fake.requests[0]['prompt'])} "
                          f"sampled: {len(fake.reply_ids or [])}")
    # The segment the example read is the engine's one call, token for token.
    reply, segment = fake.reply_ids or [], scope["segment"]
    assert len(fake.requests) == 1 and segment.prompt_ids == fake.requests[0]["prompt"]
    assert segment.response_ids == reply and segment.loss_mask == [1] * len(reply)
    assert segment.logprobs == [-0.1 * (i + 1) for i in range(len(reply))]

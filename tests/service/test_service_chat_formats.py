"""Suite jobs honour the chat format: a job's `chat_format` (else the service's) is how
its trajectories are rendered, on a scripted engine over HTTP; an unknown one is
refused naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from engines.engines_fakes import FakeVLLMServer
from treadle.client import RolloutClient
from treadle.sandbox.local import LocalBackend
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import TrajectoryStatus

pytestmark = [pytest.mark.integration]


def test_a_suite_job_is_rendered_in_its_chat_format_and_an_unknown_one_is_refused(
        tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    im_end = tok.token_id("<|im_end|>")
    reply = [*tok.encode("<think>\nthe tool is not needed\n</think>\n\nthe answer is 3"),
             im_end]
    fake = FakeVLLMServer(reply_ids=reply)
    with fake.serve() as engine:
        config = ServiceConfig(db=str(tmp_path / "s.db"), policy="verl",
                               engines=[EngineRequest(url=engine, model="m")],
                               tokenizer=str(tmp_path / "tok"), sandbox=LocalBackend())
        with running_service(config) as url, RolloutClient(url) as client:
            refused = httpx.post(f"{url}/v1/jobs", json={
                "tasks": {"suite": "math", "count": 1}, "chat_format": "llama9"})
            assert refused.status_code == 422 and "chat_format" in refused.text
            assert "qwen3" in refused.text  # it names the formats it has
            prompts = {}
            for fmt in ("qwen3", None):
                body = {"tasks": {"suite": "math", "count": 1, "seed": 3}}
                if fmt is not None:
                    body["chat_format"] = fmt
                job = httpx.post(f"{url}/v1/jobs", json=body).json()["job_id"]
                (traj,) = [d.trajectory for d in client.trajectories(job, follow=True)]
                assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
                prompts[fmt] = tok.decode(traj.segments[0].prompt_ids)
                # What the engine was sent is what the record holds.
                assert fake.requests[-1]["prompt"] == traj.segments[0].prompt_ids
    # Qwen3 has no default system message: its system turn is the tool block alone.
    assert prompts["qwen3"].startswith("<|im_start|>system\n# Tools\n")
    assert prompts[None].startswith("<|im_start|>system\nYou are a helpful assistant.\n\n"
                                    "# Tools\n")  # the service's default: hermes

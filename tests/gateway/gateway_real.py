"""What the gateway's tests on REAL vLLM share: `Served` (the service in this process
in front of a real vLLM serving the small trained model, every engine call recorded;
the `served` fixture of `tests/gateway/conftest.py`, one for the whole session) and
`assert_token_exact` (a trajectory against what vLLM was sent and returned)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.service_helpers import running_service
from treadle.client import RolloutClient
from treadle.engines.base import Engine
from treadle.sandbox.bwrap import BwrapBackend
from treadle.service import state
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.types import Trajectory
from vllm_server import RecordingEngine, VLLMServer, serve_vllm

TOKEN = "gw-real"
LIMITS = {"max_total_tokens": 1024, "max_tokens_per_turn": 200, "max_turns": 6}


@dataclass
class Served:
    url: str
    engine: RecordingEngine  # every call the service made to vLLM, with vLLM's reply
    http: httpx.Client
    vllm: VLLMServer  # the vLLM server itself (another service may use it too)

    def session(self, **body: Any) -> dict[str, Any]:
        created = self.http.post("/v1/sessions", json={"limits": LIMITS, **body})
        assert created.status_code == 201, created.text
        info: dict[str, Any] = created.json()
        return info

    def end(self, info: dict[str, Any], **body: Any) -> None:
        ended = self.http.post(f"/v1/sessions/{info['session_id']}/end", json=body)
        assert ended.status_code == 200, ended.text

    def trajectories(self, job_id: str) -> list[Trajectory]:
        with RolloutClient(self.url, token=TOKEN) as client:
            return [d.trajectory for d in client.trajectories(job_id)]


@contextlib.contextmanager
def serving(trained_checkpoint: Path, work: Path) -> Iterator[Served]:
    """A real vLLM serving `trained_checkpoint` and the service in front of it."""
    recorded: list[RecordingEngine] = []
    real_client = state.engine_client

    def recording(request: EngineRequest) -> Engine:
        recorded.append(RecordingEngine(real_client(request)))
        return recorded[-1]

    with serve_vllm(trained_checkpoint, work) as server, contextlib.ExitStack() as stack:
        config = ServiceConfig(db=str(work / "s.db"), token=TOKEN, policy="verl",
                               engines=[EngineRequest(url=server.url, model=server.model)],
                               tokenizer=str(trained_checkpoint))
        # The service makes its engine clients when it starts: patched only until then,
        # so that nothing else of a long test session is recorded.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(state, "engine_client", recording)
            url = stack.enter_context(running_service(config))
        http = stack.enter_context(httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=120))
        yield Served(url, recorded[0], http, server)


def assert_token_exact(traj: Trajectory, engine: RecordingEngine) -> int:
    """Every engine call of `traj` against its record; returns the calls checked.

    Each run of mask-1 tokens is one call's reply: the call's prompt must be the
    segment's context before it, its ids and logprobs the run's; every other token
    (prompts, new messages, forced prefixes) is mask 0."""
    calls = [(req, res) for req, res in engine.calls
             if req.request_id.rsplit(":", 2)[0] == traj.trajectory_id]
    calls.sort(key=lambda c: int(c[0].request_id.rsplit(":", 2)[1]))
    k = 0
    for seg in traj.segments:
        pos = 0
        while pos < len(seg.response_ids):
            if seg.loss_mask[pos] == 0:
                pos += 1
                continue
            req, res = calls[k]
            n = len(res.output_ids)
            assert req.prompt_ids == seg.prompt_ids + seg.response_ids[:pos]
            assert seg.response_ids[pos:pos + n] == res.output_ids
            assert seg.logprobs[pos:pos + n] == res.logprobs  # bit for bit
            assert seg.loss_mask[pos:pos + n] == [1] * n
            k += 1
            pos += n
    assert k == len(calls), (k, len(calls))  # no call whose reply is not in the record
    return k


@contextlib.contextmanager
def sandboxed_service(served: Served, trained_checkpoint: Path,
                      data_roots: tuple[str, ...] = ()
                      ) -> Iterator[tuple[str, RecordingEngine]]:
    """A second service, with bwrap sandboxes (and `data_roots`), in front of the
    served vLLM; every engine call it makes recorded."""
    recorded: list[RecordingEngine] = []
    real_client = state.engine_client

    def recording(request: EngineRequest) -> Engine:
        recorded.append(RecordingEngine(real_client(request)))
        return recorded[-1]

    # Under /tmp: the sandbox uid must be able to traverse every parent of its work dir.
    root = Path(tempfile.mkdtemp(prefix="treadle-sandboxed-", dir="/tmp"))
    os.chmod(root, 0o711)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        config = ServiceConfig(db=str(root / "s.db"), token=TOKEN, policy="verl",
                               engines=[EngineRequest(url=served.vllm.url,
                                                      model=served.vllm.model)],
                               tokenizer=str(trained_checkpoint),
                               sandbox=BwrapBackend(work_root=str(root)),
                               data_roots=data_roots)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(state, "engine_client", recording)
            url = stack.enter_context(running_service(config))
        yield url, recorded[0]

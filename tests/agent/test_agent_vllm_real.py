"""The agent loop on a REAL vLLM server (CPU build) serving the trained small model
(`trained_checkpoint`): episodes in which the model calls the real python tool in a
sandbox, reads the result and submits an answer.

Checked on every multi-turn episode: each engine call's prompt was exactly the
trajectory so far (never re-tokenized); the sampled tokens and their logprobs are
bit for bit what vLLM returned, call after call; the loss mask covers exactly those
tokens and the tool observations between them have mask 0 and logprob 0.0; and the
model's teacher-forced logprobs (transformers, fp32, on the whole context) match the
engine's within 1e-3 on every sampled token.
"""

from __future__ import annotations

import asyncio
from itertools import groupby
from pathlib import Path

import pytest

from treadle.agent.tokenizer import HFTokenizer
from treadle.engines.base import GenerateRequest, GenerateResult
from treadle.engines.vllm import VLLMEngine
from treadle.sandbox.registry import get_backend
from treadle.train.evaluate import Rollout, rollouts
from treadle.train.logprobs import teacher_forced_logprobs
from treadle.train.model import load_model
from treadle.train.transcripts import heldout_tasks
from vllm_server import RecordingEngine, serve_vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _episodes(checkpoint: Path, work: Path) -> tuple[list[Rollout], RecordingEngine]:
    with serve_vllm(checkpoint, work) as server:
        engine = RecordingEngine(VLLMEngine(server.url, server.model))
        runs = asyncio.run(asyncio.wait_for(
            rollouts(engine, HFTokenizer(checkpoint), heldout_tasks(8), get_backend("local"),
                     samples=2), 300))
    return runs, engine


def _calls_of(engine: RecordingEngine,
              traj_id: str) -> list[tuple[GenerateRequest, GenerateResult]]:
    """The trajectory's engine calls in order (request ids are ``<traj id>-<n>``)."""
    mine = [(int(req.request_id.rsplit("-", 1)[1]), req, res) for req, res in engine.calls
            if req.request_id.rsplit("-", 1)[0] == traj_id]
    return [(req, res) for _, req, res in sorted(mine, key=lambda c: c[0])]


def test_tool_calling_episodes_are_token_exact(trained_checkpoint: Path,
                                               tmp_path: Path) -> None:
    runs, engine = _episodes(trained_checkpoint, tmp_path)
    multi = [r for r in runs if len(r.trajectory.turns) >= 2 and r.calls
             and r.calls[0] == ("python", True)]
    # 95% of this checkpoint's episodes run a program and then answer.
    assert len(multi) >= 8, [(len(r.trajectory.turns), r.calls) for r in runs]
    model = load_model(trained_checkpoint)
    tokenizer = HFTokenizer(trained_checkpoint)
    worst = 0.0
    for run in multi:
        traj = run.trajectory
        (seg,) = traj.segments
        seg.validate()
        calls = _calls_of(engine, traj.trajectory_id)
        assert len(calls) == len(traj.turns)
        offset = 0
        for i, (request, result) in enumerate(calls):
            assert request.prompt_ids == seg.prompt_ids + seg.response_ids[:offset]
            end = offset + len(result.output_ids)
            assert seg.response_ids[offset:end] == result.output_ids
            assert seg.logprobs[offset:end] == result.logprobs  # bit for bit
            assert seg.loss_mask[offset:end] == [1] * len(result.output_ids)
            # Up to the next call's prompt: the tool's observation, template tokens.
            last = i + 1 == len(calls)
            offset = (len(seg.response_ids) if last else
                      len(calls[i + 1][0].prompt_ids) - len(seg.prompt_ids))
            observation = seg.response_ids[end:offset]
            assert seg.loss_mask[end:offset] == [0] * len(observation)
            assert seg.logprobs[end:offset] == [0.0] * len(observation)
            if not last:
                assert "<tool_response>" in tokenizer.decode(observation)
        assert offset == len(seg.response_ids)
        runs_of_mask = [m for m, _ in groupby(seg.loss_mask)]
        assert runs_of_mask[0] == 1 and runs_of_mask.count(1) == len(calls)
        forced = teacher_forced_logprobs(model, seg.prompt_ids, seg.response_ids)
        deltas = [abs(f - lp) for f, lp, m in zip(forced, seg.logprobs, seg.loss_mask,
                                                   strict=True) if m]
        worst = max(worst, *deltas)
    assert worst < 1e-3, f"max |teacher-forced - engine| {worst:.2e}"

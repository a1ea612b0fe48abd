"""Evaluation through the real agent loop, and the transcripts' fit with that loop."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from treadle.agent.tokenizer import HFTokenizer
from treadle.engines import Engine, EngineLoad, GenerateRequest, GenerateResult
from treadle.sandbox.local import LocalBackend
from treadle.train.evaluate import evaluate, evaluate_checkpoint
from treadle.train.transcripts import Transcript, tokenize, train_tasks


class FakeTranscriptEngine(Engine):
    """Replies with a transcript's reply tokens when the context is exactly the
    transcript's pieces so far, else with a wrong answer; records every context."""

    def __init__(self, tokenizer: HFTokenizer, transcripts: list[Transcript]) -> None:
        self.replies: dict[tuple[int, ...], list[int]] = {}
        for t in transcripts:
            ex = tokenize(t, tokenizer)
            cut = [sum(ex.piece_lengths[:k]) for k in range(5)]
            self.replies[tuple(ex.ids[:cut[1]])] = ex.ids[cut[1]:cut[2]]
            self.replies[tuple(ex.ids[:cut[3]])] = ex.ids[cut[3]:cut[4]]
        self.wrong = tokenizer.encode('<tool_call>\n{"name": "submit_answer", "arguments": '
                                      '{"answer": "-1"}}\n</tool_call><|im_end|>')
        self.contexts: list[list[int]] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.contexts.append(list(request.prompt_ids))
        ids = self.replies.get(tuple(request.prompt_ids), self.wrong)
        return GenerateResult(request.request_id, ids, [0.0] * len(ids), "stop",
                              len(request.prompt_ids), None, None, 0.0)

    async def abort(self, request_id: str) -> None:
        pass

    async def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0.0)

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def test_transcripts_are_what_the_agent_loop_builds(tiny_dir: Path,
                                                    transcripts: list[Transcript]) -> None:
    tok = HFTokenizer(tiny_dir)
    engine = FakeTranscriptEngine(tok, transcripts[:8])
    tasks = train_tasks(8)
    report = asyncio.run(evaluate(engine, tok, tasks, LocalBackend()))
    # Every context the loop sent was a transcript prefix, so every reply was the
    # transcript's, every program ran and every answer was right.
    assert len(engine.contexts) == 16
    assert all(tuple(c) in engine.replies for c in engine.contexts)
    assert (report.trajectories, report.success, report.well_formed, report.submitted) == (
        8, 1.0, 1.0, 1.0)
    assert report.statuses == {"completed": 8} and report.mean_turns == 2.0
    # A different task gets the wrong answer: reward 0, not well formed.
    other = [replace(tasks[0], task_id="other", prompt=tasks[0].prompt + " ")]
    miss = asyncio.run(evaluate(engine, tok, other, LocalBackend()))
    assert (miss.success, miss.well_formed, miss.submitted) == (0.0, 0.0, 1.0)


def test_evaluate_checkpoint_runs_real_episodes_and_is_seeded(tiny_dir: Path) -> None:
    a = evaluate_checkpoint(tiny_dir, tasks=4, samples=2, seed=5)
    b = evaluate_checkpoint(tiny_dir, tasks=4, samples=2, seed=5)
    assert a.trajectories == 8 and sum(a.statuses.values()) == 8
    assert 0.0 <= a.success <= a.submitted <= 1.0 and 1.0 <= a.mean_turns <= 4.0
    assert replace(a, seconds=0.0) == replace(b, seconds=0.0)

"""Test doubles for the agent loop: a BPE tokenizer trained here, a scripted runner."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from treadle.agent.runner import Sampling, TurnOutput
from treadle.agent.tokenizer import HFTokenizer
from treadle.clock import MONOTONIC, Clock
from treadle.engines.errors import EngineError

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the tool call returns a result", "<tool_call> python print submit_answer",
          '{"name": "python", "arguments": {"code": "print(1 + 2)"}}', "0123456789 +-*/()"]


def build_tokenizer(directory: Path) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory)


@dataclass
class FakeScriptedRunner:
    """A `TurnRunner` that 'samples' scripted reply texts (encoded with `tokenizer`),
    cut at max_tokens as an engine would be, with made-up logprobs; records events."""

    tokenizer: HFTokenizer
    replies: Sequence[str]  # reply texts, each ending with <|im_end|> unless cut
    delay_s: float = 0.0  # seconds of `clock` each turn takes (deadline tests)
    clock: Clock = MONOTONIC  # what `delay_s` is slept on
    fail_on_turn: int | None = None  # raise EngineError on this turn
    version: int = 3  # policy version stamped on every token
    events: list[tuple[object, ...]] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # context sent each turn
    outputs: list[TurnOutput] = field(default_factory=list)
    samplings: list[Sampling] = field(default_factory=list)  # parameters sent each turn
    generating: asyncio.Event = field(default_factory=asyncio.Event)  # a turn has started

    @property
    def policy_version(self) -> int:
        return self.version

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling,
                       stop_ids: list[int]) -> TurnOutput:
        turn = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        self.events.append(("generate", max_tokens))
        self.generating.set()
        if self.delay_s:
            await self.clock.sleep(self.delay_s)
        if self.fail_on_turn == turn:
            raise EngineError("engine e1 unreachable")
        ids = self.tokenizer.encode(self.replies[turn])
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        out = TurnOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))],
                         [self.version] * len(ids), finish, "e1", 0.25, 0.5)  # type: ignore[arg-type]
        self.outputs.append(out)
        return out

    def turn_finished(self, output_tokens: int, context_tokens: int, final: bool) -> None:
        self.events.append(("turn", output_tokens, context_tokens, final))

    def tool_started(self) -> None:
        self.events.append(("tool_started",))

    def tool_finished(self, latency_s: float, output_tokens: int, final: bool) -> None:
        self.events.append(("tool_finished", output_tokens, final))

    def ended(self, reason: str) -> None:
        self.events.append(("ended", reason))

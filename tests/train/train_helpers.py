"""Shared pieces of the train tests: a tiny model config and transcript recording."""

from __future__ import annotations

import asyncio
from pathlib import Path

from treadle.sandbox.local import LocalBackend
from treadle.train.model import ModelConfig, build_model, save_checkpoint, train_tokenizer
from treadle.train.transcripts import Transcript, record_transcripts, train_tasks

# Small enough that a forward pass is instant; head_dim 64 as vLLM's CPU needs.
TINY = ModelConfig(hidden_size=64, layers=2, heads=1, kv_heads=1,
                   intermediate_size=128)


def record(n: int, seed: int = 0) -> list[Transcript]:
    """`n` real transcripts (the python tool runs in `local` sandboxes)."""
    return asyncio.run(record_transcripts(train_tasks(n, seed), LocalBackend()))


def tiny_checkpoint(directory: Path, found: list[Transcript], seed: int = 0) -> Path:
    """An untrained TINY model with a tokenizer trained on `found`, saved to `directory`."""
    tok = train_tokenizer((p for t in found for p in t.pieces), TINY.vocab_size)
    save_checkpoint(build_model(TINY, tok.get_vocab_size(), seed), tok, directory)
    return directory

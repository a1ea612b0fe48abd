"""SFT: the loss falls, runs are deterministic, the checkpoint is cached by its inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import TINY

from treadle.agent.tokenizer import HFTokenizer
from treadle.train.model import load_model, weights_digest
from treadle.train.sft import (
    META_FILE,
    SFTConfig,
    _batch,
    cache_key,
    lr_at,
    masked_loss,
    mixed,
    sft,
    train,
)
from treadle.train.transcripts import Transcript, tokenize

CONFIG = SFTConfig(model=TINY, train_tasks=24, steps=16, batch_size=8, lr=3e-3, warmup_steps=4)


def test_training_lowers_the_masked_loss(tiny_dir: Path, transcripts: list[Transcript]) -> None:
    tok = HFTokenizer(tiny_dir)
    examples = [tokenize(t, tok) for t in transcripts]
    probe = _batch(examples[:8])
    with torch.no_grad():
        before = masked_loss(load_model(tiny_dir), *probe).item()
    model, history = train(CONFIG, examples, load_model(tiny_dir).config.vocab_size,
                           log=lambda _: None, log_every=4)
    with torch.no_grad():
        after = masked_loss(model, *probe).item()
    assert [h["step"] for h in history] == [4, 8, 12, 16]
    assert after < 0.7 * before
    assert history[-1]["loss"] < history[0]["loss"]


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    c = SFTConfig(steps=100, lr=1.0, warmup_steps=10)
    assert lr_at(0, c) == pytest.approx(0.1) and lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(1.0) and lr_at(100, c) == pytest.approx(0.1)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 100))


def test_cache_key_covers_the_config() -> None:
    keys = {cache_key(c) for c in (CONFIG, SFTConfig(model=TINY, train_tasks=24, steps=17),
                                   SFTConfig(model=TINY, train_tasks=24, steps=16, seed=1),
                                   SFTConfig(model=TINY, train_tasks=25, steps=16),
                                   SFTConfig(model=TINY, train_tasks=24, steps=16,
                                             direct_share=0.5))}
    assert len(keys) == 5
    assert cache_key(CONFIG) == cache_key(SFTConfig(**CONFIG.as_dict() | {"model": TINY}))


@pytest.mark.slow
def test_sft_is_cached_and_deterministic(tmp_path: Path) -> None:
    logs: list[str] = []
    first = sft(CONFIG, tmp_path / "a", log=logs.append)
    assert first.name == f"sft-{cache_key(CONFIG)}"
    assert any("recorded 24 transcripts" in line for line in logs)
    meta = json.loads((first / META_FILE).read_text())
    assert meta["config"] == CONFIG.as_dict() and meta["history"][-1]["step"] == 16
    assert meta["weights_sha256"] == weights_digest(load_model(first))
    HFTokenizer(first)  # loads
    logs.clear()
    stamp = (first / META_FILE).stat().st_mtime_ns
    assert sft(CONFIG, tmp_path / "a", log=logs.append) == first
    assert logs == [] and (first / META_FILE).stat().st_mtime_ns == stamp  # no work done
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if "tmp" in p.name) == []
    again = sft(CONFIG, tmp_path / "b", log=logs.append)  # a fresh cache: trains again
    assert json.loads((again / META_FILE).read_text())["weights_sha256"] == meta["weights_sha256"]
    assert (again / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_too_few_examples_for_a_batch_is_refused(transcripts: list[Transcript],
                                                 tiny_dir: Path) -> None:
    examples = [tokenize(t, HFTokenizer(tiny_dir)) for t in transcripts[:3]]
    with pytest.raises(ValueError, match="cannot fill a batch of 8"):
        train(CONFIG, examples, 1024, log=lambda _: None)


def test_direct_share_replaces_that_many_transcripts_by_seed(
        transcripts: list[Transcript]) -> None:
    assert mixed(transcripts, SFTConfig()) == transcripts
    half = mixed(transcripts, SFTConfig(direct_share=0.5))
    assert [len(t.pieces) for t in half].count(2) == len(transcripts) // 2
    assert [t.task_id for t in half] == [t.task_id for t in transcripts]  # order kept
    for before, after in zip(transcripts, half, strict=True):
        assert after in (before, before.answered_directly())
    assert mixed(transcripts, SFTConfig(direct_share=0.5)) == half
    other = mixed(transcripts, SFTConfig(direct_share=0.5, seed=1))
    assert [len(t.pieces) for t in other] != [len(t.pieces) for t in half]
    with pytest.raises(ValueError, match="direct_share"):
        SFTConfig(direct_share=1.0)

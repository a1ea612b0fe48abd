"""Teacher-forced logprobs against a plain step-by-step forward pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treadle.train.logprobs import segment_logprob_gaps, teacher_forced_logprobs, token_logprobs
from treadle.train.model import load_model
from treadle.types import TokenSegment


def _one_by_one(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response[i] | prompt + response[:i]), one full forward pass per token."""
    out = []
    with torch.no_grad():
        for i, token in enumerate(response):
            ids = torch.tensor([prompt + response[:i]])
            logits = model(input_ids=ids).logits[0, -1].double()
            out.append(float(torch.log_softmax(logits, -1)[token]))
    return out


def test_teacher_forced_logprobs_match_a_forward_pass_per_token(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=gen).tolist()
    response = torch.randint(3, model.config.vocab_size, (12,), generator=gen).tolist()
    got = teacher_forced_logprobs(model, prompt, response)
    want = _one_by_one(model, prompt, response)
    assert len(got) == len(response)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert all(x <= 0.0 for x in got)
    assert teacher_forced_logprobs(model, prompt, []) == []
    with pytest.raises(ValueError, match="prompt_ids"):
        teacher_forced_logprobs(model, [], response)


def test_batch_with_right_padding_matches_each_sequence_and_has_gradients(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    seqs = [[5, 9, 14, 3, 22, 7], [8, 4, 30]]
    width = max(map(len, seqs))
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)], mask[row, :len(s)] = torch.tensor(s), 1
    batch = token_logprobs(model, ids, mask)
    assert batch.shape == (2, width - 1) and batch.dtype == torch.float32
    for row, s in enumerate(seqs):
        single = teacher_forced_logprobs(model, s[:1], s[1:])
        assert batch[row, :len(s) - 1].tolist() == pytest.approx(single, abs=1e-5)
    batch[0].sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_segment_gaps_compare_only_sampled_tokens(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    prompt, response, mask = [1, 20, 21], [30, 31, 5, 6, 32], [1, 1, 0, 0, 1]
    forced = teacher_forced_logprobs(model, prompt, response)
    engine = [lp + 0.5 * m for lp, m in zip(forced, mask, strict=True)]
    engine = [e if m else 0.0 for e, m in zip(engine, mask, strict=True)]
    seg = TokenSegment(prompt, response, mask, engine, [0] * 5)
    assert segment_logprob_gaps(model, seg) == pytest.approx([0.5, 0.5, 0.5], abs=1e-6)

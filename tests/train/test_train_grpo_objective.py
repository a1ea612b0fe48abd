"""The GRPO update's objective, token by token (tiny model, hand-made sequences).

`policy_gradient_step` must push a sampled token's log-probability up under a
positive advantage and down under a negative one; give observation, prompt and
padding tokens (mask 0) exactly zero gradient; stop the gradient of a token whose
ratio has left [1 - clip, 1 + clip] on the side its advantage favours (PPO's clip);
and, with ``negative_scale`` 0, take nothing from trajectories with a negative
advantage. The gradient that reaches each token's log-probability is read with a
spy on `token_logprobs` (the real function, its output's gradient recorded); the
optimizer is plain SGD, so weights move by the gradient alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import treadle.train.update as update
from treadle.client.samples import TrainingSequence
from treadle.train.grpo_config import GRPOConfig
from treadle.train.logprobs import teacher_forced_logprobs
from treadle.train.model import load_model, weights_digest
from treadle.train.update import policy_gradient_step
from treadle.types import TrajectoryStatus

AGGREGATIONS = ["seq-mean-token-mean", "token-mean"]


def sequence(model: torch.nn.Module, i: int, advantage: float,
             shift: list[float] | None = None) -> TrainingSequence:
    """Sequence `i`: a prompt, then model tokens, an observation run (mask 0) and
    model tokens again, of a length that differs with `i`. The engine's logprobs are
    the model's own (on-policy) plus `shift` per sampled token (old = new + shift:
    the ratio is exp(-shift)), 0.0 at mask 0."""
    prompt = [5 + i, 6, 7]
    response = [8 + (j * 7 + i) % 50 for j in range(9 + 2 * i)]
    mask = [1, 1, 1, 0, 0, 0] + [1] * (len(response) - 6)
    own = teacher_forced_logprobs(model, prompt, response)
    shifts = iter(shift or [])
    logprobs = [lp + next(shifts, 0.0) if m else 0.0 for lp, m in zip(own, mask, strict=True)]
    return TrainingSequence(
        trajectory_id=f"t{i}", group_id="g", task_id="task", repetition=i, segment_index=0,
        num_segments=1, prompt_ids=prompt, response_ids=response, loss_mask=mask,
        logprobs=logprobs, policy_versions=[0] * len(response), reward=advantage,
        advantage=advantage, status=TrajectoryStatus.COMPLETED, excluded=None)


class GradientSpy:
    """Wraps `token_logprobs`: records, for every differentiable call, the padded ids
    and the gradient that the loss sends to each entry's log-probability."""

    def __init__(self) -> None:
        self.real = update.token_logprobs
        self.calls: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def __call__(self, model: Any, ids: torch.Tensor,
                 attention: torch.Tensor | None = None) -> torch.Tensor:
        out = self.real(model, ids, attention)
        if out.requires_grad:
            grads: list[torch.Tensor] = []
            out.register_hook(lambda g: grads.append(g.detach().clone()))
            self.calls.append((ids.clone(), grads))
        return out

    def per_sequence(self, rows: list[TrainingSequence]) -> dict[str, torch.Tensor]:
        """trajectory id -> the gradient on its targets (padding cut): entry t is
        d loss / d log p(token t+1 | tokens up to t) for the first step's batch."""
        out: dict[str, torch.Tensor] = {}
        for ids, grads in self.calls:
            (grad,) = grads
            for b in range(ids.shape[0]):
                for r in rows:
                    tokens = r.prompt_ids + r.response_ids
                    if ids[b, :len(tokens)].tolist() == tokens and r.trajectory_id not in out:
                        out[r.trajectory_id] = grad[b, :len(tokens) - 1]
        assert set(out) == {r.trajectory_id for r in rows if r.advantage}, out.keys()
        return out


def targets_mask(r: TrainingSequence) -> torch.Tensor:
    """The loss mask on the target positions of prompt + response (prompt targets 0)."""
    return torch.tensor([0] * (len(r.prompt_ids) - 1) + r.loss_mask, dtype=torch.bool)


def step(model: torch.nn.Module, rows: list[TrainingSequence], monkeypatch: pytest.MonkeyPatch,
         lr: float = 0.05, **overrides: Any) -> tuple[float, GradientSpy]:
    """One optimizer step (one epoch, one minibatch, SGD) on `rows`: its loss, and
    the spy that saw the gradients."""
    torch.manual_seed(0)
    spy = GradientSpy()
    monkeypatch.setattr(update, "token_logprobs", spy)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    config = GRPOConfig(epochs=1, minibatches=1, **overrides)
    loss, _gap = policy_gradient_step(model, optimizer, rows, config)
    return loss, spy


def sampled_logprob(model: torch.nn.Module, r: TrainingSequence) -> float:
    """Sum of the log-probabilities of `r`'s sampled tokens (mask 1) under `model`."""
    lps = teacher_forced_logprobs(model, r.prompt_ids, r.response_ids)
    return math.fsum(lp for lp, m in zip(lps, r.loss_mask, strict=True) if m)


@pytest.mark.parametrize("loss_agg", AGGREGATIONS)
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_an_advantage_moves_the_sampled_tokens_logprobs_its_way(
        tiny_dir: Path, advantage: float, loss_agg: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(tiny_dir)
    rows = [sequence(model, i, advantage) for i in range(2)]
    before = [sampled_logprob(model, r) for r in rows]
    step(model, rows, monkeypatch, loss_agg=loss_agg)
    after = [sampled_logprob(model, r) for r in rows]
    moved = math.fsum(after) - math.fsum(before)
    # Up under a positive advantage, down under a negative one, clearly.
    assert moved * advantage > 1e-3, (before, after)


@pytest.mark.parametrize("loss_agg", AGGREGATIONS)
def test_tokens_with_mask_0_get_exactly_zero_gradient(
        tiny_dir: Path, loss_agg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(tiny_dir)
    rows = [sequence(model, 0, 1.0), sequence(model, 1, -0.5), sequence(model, 2, 0.25)]
    _loss, spy = step(model, rows, monkeypatch, loss_agg=loss_agg)
    # The whole padded batch: the sampled tokens' entries are its only non-zero ones
    # (prompt, observation and padding entries get exactly 0.0).
    (ids, (grad,)), = spy.calls
    assert ids.shape[0] == len(rows) and ids.shape[1] > len(rows[0].prompt_ids) + \
        len(rows[0].response_ids)  # the shortest row was padded
    assert torch.count_nonzero(grad) == sum(sum(r.loss_mask) for r in rows)
    for r in rows:
        g, sampled = spy.per_sequence(rows)[r.trajectory_id], targets_mask(r)
        assert torch.count_nonzero(g[~sampled]) == 0, (r.trajectory_id, g)
        # A positive advantage asks for more probability: a negative gradient of the
        # loss on every sampled token, and the reverse.
        assert bool((torch.sign(g[sampled]) == -math.copysign(1.0, r.advantage or 0)).all()), \
            (r.trajectory_id, g)


@pytest.mark.parametrize("side", ["favoured", "opposed"])
@pytest.mark.parametrize("clip", [0.2, 0.5])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_ratio_past_the_clip_on_the_favoured_side_gets_no_gradient(
        tiny_dir: Path, advantage: float, clip: float, side: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every other sampled token's engine logprob is moved by 0.3, so its ratio is
    # exp(±0.3) (1.35 or 0.74): past a clip of 0.2, within one of 0.5. Moved the way
    # its advantage favours (up for a positive one), PPO's clip holds it at the bound
    # and it gets no gradient; moved the other way, the min keeps the raw ratio.
    model = load_model(tiny_dir)
    log_ratio = 0.3 * advantage * (1 if side == "favoured" else -1)
    shift = [-log_ratio if k % 2 == 0 else 0.0 for k in range(20)]  # old = new - log ratio
    (row,) = rows = [sequence(model, 0, advantage, shift)]
    loss, spy = step(model, rows, monkeypatch, clip=clip)
    grad = spy.per_sequence(rows)[row.trajectory_id][targets_mask(row)]
    moved = torch.tensor([k % 2 == 0 for k in range(sum(row.loss_mask))])
    held = side == "favoured" and clip == 0.2
    assert torch.count_nonzero(grad[~moved]) == len(grad[~moved])  # ratio 1: trained
    assert torch.count_nonzero(grad[moved]) == (0 if held else len(grad[moved])), grad
    # The loss is -mean(min(r * A, clip(r, 1 - clip, 1 + clip) * A)) over the tokens.
    ratios = [math.exp(log_ratio) if m else 1.0 for m in moved.tolist()]
    terms = [min(r * advantage, min(max(r, 1 - clip), 1 + clip) * advantage) for r in ratios]
    assert loss == pytest.approx(-math.fsum(terms) / len(terms), abs=1e-4)


def test_negative_scale_0_takes_nothing_from_negative_advantages(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(tiny_dir)
    rows = [sequence(model, 0, 1.0), sequence(model, 1, -1.0), sequence(model, 2, -0.5)]
    _loss, spy = step(model, rows, monkeypatch, lr=0.0, negative_scale=0.0)
    grads = spy.per_sequence(rows)
    assert torch.count_nonzero(grads["t0"]) == sum(rows[0].loss_mask)
    assert torch.count_nonzero(grads["t1"]) == torch.count_nonzero(grads["t2"]) == 0
    # A half scale halves what they get; the positive one's is untouched.
    _loss, full = step(model, rows, monkeypatch, lr=0.0, negative_scale=1.0)
    _loss, half = step(model, rows, monkeypatch, lr=0.0, negative_scale=0.5)
    full_grads, half_grads = full.per_sequence(rows), half.per_sequence(rows)
    assert torch.count_nonzero(full_grads["t1"]) == sum(rows[1].loss_mask)
    for tid in ("t1", "t2"):
        assert torch.allclose(half_grads[tid], full_grads[tid] / 2, rtol=1e-5, atol=0)
    assert torch.equal(half_grads["t0"], full_grads["t0"])
    # Failures only: the weights do not move at all (plain SGD moves them by the
    # gradient alone); at scale 1 they do.
    failures = rows[1:]
    before = weights_digest(model)
    step(model, failures, monkeypatch, negative_scale=0.0)
    assert weights_digest(model) == before
    step(model, failures, monkeypatch, negative_scale=1.0)
    assert weights_digest(model) != before

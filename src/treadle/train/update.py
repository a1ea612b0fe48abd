"""The policy-gradient update of a GRPO step and the engine-vs-trainer logprob gap.

`policy_gradient_step` runs PPO's clipped-ratio objective against the logprobs the
engine recorded as it sampled (the behaviour policy: with asynchronous RL, a
token sampled one version ago is weighed by the ratio to that version's
probability, and the clip bounds how far one update moves on it). `logprob_gap`
measures how far the engine's recorded logprobs are from the trainer's on given
tokens: on tokens of the trainer's own version it is the parity of the two
implementations (about 1e-5 in fp32); on older tokens it is the policy's drift
since they were sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from treadle.client.samples import TrainingSequence
from treadle.train.grpo_config import GRPOConfig
from treadle.train.logprobs import token_logprobs

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2ForCausalLM


@dataclass(frozen=True, slots=True)
class LogprobGap:
    """|engine logprob − trainer logprob| over sampled tokens, measured on the trainer's
    weights: over the tokens sampled under the trainer's own version (`max`, `mean`:
    the parity of engine and trainer) and over tokens of older versions (`older_*`:
    how far the policy moved since they were sampled; 0 tokens in synchronous RL)."""

    max: float
    mean: float
    older_max: float = 0.0
    older_mean: float = 0.0
    older_tokens: int = 0


def policy_gradient_step(model: Qwen2ForCausalLM, optimizer: torch.optim.Optimizer,
                         sequences: Sequence[TrainingSequence],
                         config: GRPOConfig, *,
                         version: int | None = None) -> tuple[float, LogprobGap]:
    """`config.epochs` passes over the step's sequences with a non-zero advantage, each
    in `config.minibatches` optimizer steps on the clipped-ratio objective averaged
    over the minibatch's sampled tokens (PPO's update; with one epoch of one minibatch
    it is the plain GRPO gradient). Returns (mean loss, the gap between the engine's
    logprobs and the trainer's, measured before the first update): the weights are
    `version`'s, and tokens sampled under an older one count as older (None: every
    token is the weights' own)."""
    import torch

    rows = [s for s in sequences if sum(s.loss_mask)]
    gap = logprob_gap(model, rows, config.micro_batch, version=version)
    # A group whose members all scored alike has advantage 0 everywhere: no gradient.
    trained = [s for s in rows if s.advantage]
    if not trained:
        return 0.0, gap
    model.train()
    losses: list[float] = []
    for _epoch in range(config.epochs):
        order = torch.randperm(len(trained)).tolist()  # seeded in train_grpo
        parts = max(1, min(config.minibatches, len(trained)))
        for part in range(parts):
            # Micro-batches of similar lengths: padding to a long failure's length
            # would otherwise cost most of the step. The sum is order-independent.
            batch = sorted((trained[i] for i in order[part::parts]), key=_length)
            tokens = sum(sum(s.loss_mask) for s in batch)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for start in range(0, len(batch), config.micro_batch):
                ids, attention, mask, old, adv, _versions = _tensors(
                    batch[start:start + config.micro_batch])
                adv = torch.where(adv < 0, adv * config.negative_scale, adv)
                new = token_logprobs(model, ids, attention)  # (B, T-1)
                ratio = torch.exp(new - old)
                clipped = torch.clamp(ratio, 1.0 - config.clip, 1.0 + config.clip)
                objective = torch.minimum(ratio * adv[:, None], clipped * adv[:, None]) * mask
                if config.loss_agg == "token-mean":
                    loss = -objective.sum() / tokens
                else:  # seq-mean-token-mean
                    loss = -(objective.sum(1) / mask.sum(1)).sum() / len(batch)
                loss.backward()  # type: ignore[no-untyped-call]
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            losses.append(total)
    model.eval()  # type: ignore[no-untyped-call]
    return _mean(losses), gap


def logprob_gap(model: Qwen2ForCausalLM, rows: Sequence[TrainingSequence],
                micro_batch: int, *, version: int | None = None) -> LogprobGap:
    """|engine logprob − trainer logprob| over every sampled token, split by the
    version it was sampled under: `version`'s own (or every token, when None) and
    older ones (see LogprobGap)."""
    import torch

    own = [0.0, 0.0, 0.0]  # max, sum, count
    older = [0.0, 0.0, 0.0]
    rows = sorted(rows, key=_length)  # micro-batches of similar lengths
    model.eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for start in range(0, len(rows), micro_batch):
            ids, attention, mask, old, _adv, versions = _tensors(rows[start:start + micro_batch])
            gap = (token_logprobs(model, ids, attention) - old).abs()
            is_own = mask if version is None else mask * (versions == version)
            for part, m in ((own, is_own), (older, mask - is_own)):
                if float(m.sum()):
                    part[0] = max(part[0], float((gap * m).max()))
                    part[1] += float((gap * m).sum())
                    part[2] += float(m.sum())
    return LogprobGap(max=own[0], mean=own[1] / own[2] if own[2] else 0.0,
                      older_max=older[0], older_mean=older[1] / older[2] if older[2] else 0.0,
                      older_tokens=int(older[2]))


def _length(row: TrainingSequence) -> int:
    return len(row.prompt_ids) + len(row.response_ids)


def _tensors(rows: Sequence[TrainingSequence]) -> tuple[torch.Tensor, ...]:
    """Right-padded ids and attention (B, T); mask, engine logprobs (B, T-1) aligned
    with `token_logprobs`'s targets; advantages (B,); the policy version each target
    was sampled under (B, T-1; -1 where nothing was sampled)."""
    import torch

    length = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1)
    old = torch.zeros(len(rows), length - 1)
    versions = torch.full((len(rows), length - 1), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        seq = r.prompt_ids + r.response_ids
        ids[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        first = len(r.prompt_ids) - 1  # target position of the first response token
        mask[i, first:first + len(r.response_ids)] = torch.tensor(r.loss_mask,
                                                                  dtype=torch.float32)
        old[i, first:first + len(r.response_ids)] = torch.tensor(r.logprobs)
        versions[i, first:first + len(r.response_ids)] = torch.tensor(r.policy_versions)
    adv = torch.tensor([r.advantage or 0.0 for r in rows])
    return ids, attention, mask, old, adv, versions


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0

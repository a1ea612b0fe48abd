"""Teacher-forced log-probabilities: what the model assigns to tokens it is shown.

`token_logprobs` is the differentiable batch form (the RL trainer's policy term);
`teacher_forced_logprobs` the one-sequence form that engine logprobs are checked
against (vLLM's sampled-token logprobs must match it within 1e-3 on the same
weights). Both are fp32 log-softmax of the raw logits, with no temperature: the
engines report raw logprobs by default (vLLM's ``logprobs_mode=raw_logprobs``), and
at temperature 1.0 the sampling distribution is this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from treadle.types import TokenSegment

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def token_logprobs(model: PreTrainedModel, ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T-1) fp32: entry [b, t] is log p(ids[b, t+1] | ids[b, :t+1]).

    `ids` is (B, T), right-padded where `attention_mask` (B, T) is 0; entries whose
    target is padding are meaningless and must be masked by the caller. Gradients
    flow unless the caller disables them.
    """
    import torch

    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def teacher_forced_logprobs(model: PreTrainedModel, prompt_ids: Sequence[int],
                            response_ids: Sequence[int]) -> list[float]:
    """The log-probability of each response token given everything before it (the
    prompt and the earlier response tokens), one forward pass, no gradient."""
    import torch

    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty: the first response token needs a "
                         "context")
    if not response_ids:
        return []
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    with torch.no_grad():
        logp = token_logprobs(model, ids)
    return [float(x) for x in logp[0, len(prompt_ids) - 1:]]


def segment_logprob_gaps(model: PreTrainedModel, segment: TokenSegment) -> list[float]:
    """|engine logprob - teacher-forced logprob| of every sampled token (mask 1) of a
    trajectory segment: what an engine/trainer parity check takes the max of."""
    forced = teacher_forced_logprobs(model, segment.prompt_ids, segment.response_ids)
    return [abs(engine - mine) for engine, mine, m
            in zip(segment.logprobs, forced, segment.loss_mask, strict=True) if m]

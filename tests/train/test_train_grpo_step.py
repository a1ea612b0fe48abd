"""The GRPO update on its own (tiny model, hand-made sequences, no engine): zero
advantages train nothing, epochs x minibatches optimizer steps are taken, the two
loss aggregations differ, the same seed gives the same weights; the report's tool
use is read from the turns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treadle.client.samples import TrainingSequence
from treadle.train.grpo import GRPOConfig, called_python, logprob_gap, policy_gradient_step
from treadle.train.logprobs import teacher_forced_logprobs
from treadle.train.model import load_model, weights_digest
from treadle.types import GroupKey, ToolCall, Trajectory, TrajectoryStatus, Turn


def _sequences(model: torch.nn.Module, advantages: list[float]) -> list[TrainingSequence]:
    """One sequence per advantage, of different lengths, with the model's own logprobs
    as the engine's (on-policy, as a rollout on the same weights would give)."""
    rows = []
    for i, adv in enumerate(advantages):
        prompt, response = [5, 6, 7], [8 + (j * 7 + i) % 50 for j in range(4 + 3 * i)]
        mask = [1] * len(response)
        mask[1] = 0  # an observation token in the middle
        lp = teacher_forced_logprobs(model, prompt, response)
        rows.append(TrainingSequence(
            trajectory_id=f"t{i}", group_id="g", task_id="task", repetition=i,
            segment_index=0, num_segments=1, prompt_ids=prompt, response_ids=response,
            loss_mask=mask, logprobs=[x if m else 0.0 for x, m in zip(lp, mask, strict=True)],
            policy_versions=[0] * len(response), reward=adv, advantage=adv,
            status=TrajectoryStatus.COMPLETED, excluded=None))
    return rows


def _step(checkpoint: Path, advantages: list[float], **overrides: object) -> tuple[str, int]:
    torch.manual_seed(0)
    model = load_model(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = 0
    original = optimizer.step

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal steps
        steps += 1
        return original(*args, **kwargs)

    optimizer.step = counted  # type: ignore[method-assign]
    config = GRPOConfig(**overrides)  # type: ignore[arg-type]
    rows = _sequences(model, advantages)
    _loss, gap_max, _gap_mean = policy_gradient_step(model, optimizer, rows, config)
    assert gap_max < 1e-5  # the "engine" logprobs were the model's own
    return weights_digest(model), steps


def test_zero_advantages_take_no_step(tiny_dir: Path) -> None:
    before = weights_digest(load_model(tiny_dir))
    assert _step(tiny_dir, [0.0, 0.0, 0.0]) == (before, 0)


def test_epochs_times_minibatches_optimizer_steps(tiny_dir: Path) -> None:
    before = weights_digest(load_model(tiny_dir))
    digest, steps = _step(tiny_dir, [1.0, -1.0, 0.5, -0.5], epochs=2, minibatches=2)
    assert steps == 4 and digest != before
    assert _step(tiny_dir, [1.0, -1.0, 0.5, -0.5], epochs=2, minibatches=2) == (digest, 4)


def test_loss_aggregations_differ(tiny_dir: Path) -> None:
    seq = _step(tiny_dir, [1.0, -1.0, 1.0, -1.0], epochs=1)
    tok = _step(tiny_dir, [1.0, -1.0, 1.0, -1.0], epochs=1, loss_agg="token-mean")
    assert seq[1] == tok[1] == 1 and seq[0] != tok[0]


def test_logprob_gap_counts_sampled_tokens_only(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    rows = _sequences(model, [1.0])
    rows[0].logprobs[0] -= 0.5  # a sampled token off by 0.5
    # The observation token's logprob is 0.0 against the model's ~-7: counted, it
    # would be the max and move the mean; over the sampled tokens only it is exact.
    exact_max, exact_mean = logprob_gap(model, rows, micro_batch=8)
    sampled = sum(rows[0].loss_mask)
    assert exact_max == pytest.approx(0.5, abs=1e-5)
    assert exact_mean == pytest.approx(0.5 / sampled, abs=1e-5)
    rows[0].response_ids[1] = 9  # an observation token changed: not measured ...
    gap_max, gap_mean = logprob_gap(model, rows, micro_batch=8)
    # ... but it is context for the tokens after it, whose logprobs then move too.
    assert gap_max >= 0.5 - 1e-5 and 0 < gap_mean < gap_max


@pytest.mark.parametrize("bad", ["mean", ""])
def test_an_unknown_loss_aggregation_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="loss_agg"):
        GRPOConfig(loss_agg=bad)


def test_tool_use_is_read_from_the_turns_tool_calls() -> None:
    def traj(*calls: str | None) -> Trajectory:
        return Trajectory("t", GroupKey("task", 0), turns=[
            Turn(i, 3, tool_call=ToolCall(c) if c else None) for i, c in enumerate(calls)])

    assert called_python(traj("python", "submit_answer"))
    assert called_python(traj(None, "python"))
    assert not called_python(traj("submit_answer"))
    assert not called_python(traj(None))
    assert not called_python(traj())

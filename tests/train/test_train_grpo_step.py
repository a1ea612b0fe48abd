"""The GRPO update on its own (tiny model, hand-made sequences, no engine): zero
advantages train nothing, epochs x minibatches optimizer steps are taken, the two
loss aggregations differ, the same seed gives the same weights; the report's tool
use is read from the turns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from treadle.client.samples import TrainingSequence
from treadle.client.wire import SubmittedJob
from treadle.train.grpo import StepJobs, called_python
from treadle.train.grpo_config import GRPOConfig
from treadle.train.logprobs import teacher_forced_logprobs
from treadle.train.model import load_model, weights_digest
from treadle.train.update import logprob_gap, policy_gradient_step
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
    _loss, gap = policy_gradient_step(model, optimizer, rows, config)
    assert gap.max < 1e-5  # the "engine" logprobs were the model's own
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
    exact = logprob_gap(model, rows, micro_batch=8)
    sampled = sum(rows[0].loss_mask)
    assert exact.max == pytest.approx(0.5, abs=1e-5)
    assert exact.mean == pytest.approx(0.5 / sampled, abs=1e-5)
    assert exact.older_tokens == 0
    rows[0].response_ids[1] = 9  # an observation token changed: not measured ...
    moved = logprob_gap(model, rows, micro_batch=8)
    # ... but it is context for the tokens after it, whose logprobs then move too.
    assert moved.max >= 0.5 - 1e-5 and 0 < moved.mean < moved.max


def test_logprob_gap_splits_the_trainers_own_version_from_older_ones(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    rows = _sequences(model, [1.0])
    row = rows[0]
    sampled = [j for j, m in enumerate(row.loss_mask) if m]
    row.policy_versions[:] = [1] * len(row.response_ids)
    for j in sampled[:2]:  # sampled a version ago: the policy moved since
        row.policy_versions[j] = 0
        row.logprobs[j] -= 0.3
    gap = logprob_gap(model, rows, micro_batch=8, version=1)
    assert gap.max < 1e-5 and gap.mean < 1e-5  # parity on the trainer's own version
    assert gap.older_tokens == 2
    assert gap.older_max == pytest.approx(0.3, abs=1e-5)
    assert gap.older_mean == pytest.approx(0.3, abs=1e-5)
    # Without a version every token is the weights' own, as in synchronous RL.
    assert logprob_gap(model, rows, micro_batch=8).max == pytest.approx(0.3, abs=1e-5)


class _RecordingClient:
    """A test double of RolloutClient's submit and cancel."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, int]] = []
        self.cancelled: list[str] = []

    def submit(self, **fields: Any) -> SubmittedJob:
        self.submitted.append((fields["job_id"], fields["min_policy_version"]))
        return SubmittedJob(job_id=fields["job_id"], planned=4, group_size=2)

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_step_jobs_are_submitted_as_far_ahead_as_the_staleness_bound(staleness: int) -> None:
    client = _RecordingClient()
    jobs = StepJobs(client, GRPOConfig(max_staleness=staleness, max_steps=4,  # type: ignore[arg-type]
                                       prompts_per_step=2, group_size=2))
    taken = []
    for step in range(3):
        taken.append(jobs.take(step).job_id)
        # Step s's job is in once step s - S starts, and may run on the version then.
        submitted = {int(job.split("-")[1]): version for job, version in client.submitted}
        assert submitted == {s: max(0, s - staleness)
                             for s in range(min(step + staleness, 3) + 1)}
    assert [int(j.split("-")[1]) for j in taken] == [0, 1, 2]
    jobs.cancel_ahead()  # the run stopped: the jobs of steps it will not train
    assert len(client.cancelled) == min(staleness, 1)
    assert all(job not in taken for job in client.cancelled)


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

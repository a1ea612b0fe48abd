"""SkyRL: a `GeneratorOutput` dict (skyrl/train/generators/base.py, skyrl==0.3.0).

    out = to_skyrl(trajectories, step_wise=True, trajectory_ids=ids_skyrl_sent)
    return out.data            # from a custom GeneratorInterface.generate

`treadle.client.skyrl_generator.TreadleGenerator` is such a generator, ready made: it
runs each batch SkyRL asks for as one treadle job and calls this. This module does
not import SkyRL.

Keys, one entry per row (a row is one segment): every key of SkyRL 0.3.0's
GeneratorOutput TypedDict, and ``rollout_sample_support``, a key of later SkyRL
releases that 0.3.0 lacks:

    prompt_token_ids     list[list[int]]
    response_ids         list[list[int]]
    rewards              list[float]       the trajectory's reward on each of its rows
    loss_masks           list[list[int]]
    stop_reasons         list[str]         "stop" (completed), "length" (truncated),
                                           else the status: "max_turns", "timeout"
    rollout_logprobs     list[list[float]]  the engine's logprob of each response token
                                           as recorded (0.0 where the mask is 0): an
                                           asynchronous trainer's behaviour policy
    trajectory_ids       list[TrajectoryID]  the id SkyRL gave the sample (its uid and
                                           repetition) when `trajectory_ids` maps it,
                                           else instance_id = group id, repetition_id
                                           = repetition
    is_last_step         list[bool] | None   step-wise mode only
    rollout_metrics      dict              treadle/* means and counts for the batch
                                           (treadle/mean_llm_s and mean_tool_s: the
                                           engine and tool time)
    trajectory_generation_times  list[float] | None   finished_at - started_at per
                                           row; None unless every row has both
    env_metrics          list[dict]        the reward parts, `Trajectory.metrics`, and
                                           a rubric's dimensions with a value
                                           (`Trajectory.rewards`; a dimension wins
                                           over a metric of its name)
    rollout_expert_indices, pixel_values, image_grid_thw   None
    rollout_sample_support   None          treadle records no sampler top-k support
    treadle_policy_versions  list[list[int]]  not a SkyRL key: the policy version that
                                           sampled each response token (a trajectory
                                           run across a weight update holds two), for
                                           an off-policy correction by version lag;
                                           SkyRL passes extra row-aligned keys along

No ``trajectory_time_splits``: SkyRL 0.3.0 declares none, and its step-wise merging
(`merge_stepwise_output`, generator.merge_stepwise_output=true) indexes every key
that is not None row by row, which a dict of lists fails (KeyError). Validation
(`validate_generator_output`) ignores keys it does not check, so the extra None is
harmless there.

Whose ids. SkyRL groups rows for GRPO by ``trajectory_ids[i].instance_id``, which must
be the uid it put in its GeneratorInput; pass `trajectory_ids` (treadle trajectory id
-> the TrajectoryID SkyRL sent for that sample) and every row carries SkyRL's own
object. Without it the ids are built with `trajectory_id_type` from treadle's group
id and repetition: pass SkyRL's own ``TrajectoryID`` (the default is a look-alike with
the same fields and ``to_string``).

Which mode. Without step-wise training (``step_wise=False``) SkyRL wants exactly one
row per input prompt, in input order, and takes its GRPO groups from the input
batch: so every trajectory must be trained and have one segment, and the converter
raises ConversionError otherwise. With ``generator.step_wise_trajectories=true``
(``step_wise=True``) rows are free: a trajectory contributes one row per segment
(``is_last_step`` marks its last), SkyRL computes advantages on the last rows and
broadcasts them to the trajectory's other rows, and excluded trajectories are
simply absent. SkyRL's rewards must be numbers, so an excluded trajectory is never
kept as a row here (there is no ``drop_failed=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.client.errors import ConversionError
from treadle.client.samples import Converted, training_sequences
from treadle.types import Trajectory, TrajectoryStatus


@dataclass(frozen=True, slots=True)
class SkyRLTrajectoryID:
    """The fields of SkyRL's TrajectoryID, for use without SkyRL installed."""

    instance_id: str  # the GRPO group: SkyRL's uid
    repetition_id: int  # 0..n-1 within the group

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


def stop_reason(status: TrajectoryStatus) -> str:
    """SkyRL's stop reason for a terminal status ("stop" and "length" are vLLM's)."""
    if status is TrajectoryStatus.COMPLETED:
        return "stop"
    if status is TrajectoryStatus.TRUNCATED:
        return "length"
    return str(status.value)


def to_skyrl(trajectories: Sequence[Trajectory], *, step_wise: bool = False,
             drop_group_on_failure: bool = False,
             trajectory_id_type: Callable[[str, int], Any] = SkyRLTrajectoryID,
             trajectory_ids: Mapping[str, Any] | None = None,
             ) -> Converted[dict[str, Any]]:
    """A GeneratorOutput for `trajectories` (input order). See the module docstring.

    `trajectory_ids` maps treadle trajectory ids to the ids SkyRL gave those samples;
    when given, a trajectory that trains and is missing from it is a ConversionError
    (its row would fall into a GRPO group SkyRL does not know)."""
    batch = training_sequences(trajectories, drop_failed=True,
                               drop_group_on_failure=drop_group_on_failure)
    rows = batch.sequences
    if not rows:
        raise ConversionError(f"no trajectory to train on: all {len(trajectories)} are "
                              f"excluded (SkyRL refuses an empty batch)")
    if not step_wise:
        if batch.exclusions:
            ids = ", ".join(e.trajectory_id for e in batch.exclusions[:5])
            raise ConversionError(
                f"{len(batch.exclusions)} trajectories must not train ({ids}, ...): SkyRL "
                f"without step-wise training needs one row per prompt; use step_wise=True "
                f"(generator.step_wise_trajectories=true) to drop them, or run them again")
        multi = [s.trajectory_id for s in rows if s.segment_index > 0]
        if multi:
            raise ConversionError(
                f"trajectory {multi[0]!r} has several segments: SkyRL without step-wise "
                f"training takes one row per prompt; use step_wise=True")
    if trajectory_ids is not None:
        unknown = sorted({s.trajectory_id for s in rows} - trajectory_ids.keys())
        if unknown:
            raise ConversionError(f"{len(unknown)} trajectories have no SkyRL trajectory id "
                                  f"({', '.join(unknown[:5])}, ...): trajectory_ids must map "
                                  f"every trajectory that trains")
        row_ids = [trajectory_ids[s.trajectory_id] for s in rows]
    else:
        row_ids = [trajectory_id_type(s.group_id, s.repetition) for s in rows]
    by_id = {t.trajectory_id: t for t in trajectories}
    trained = [by_id[s.trajectory_id] for s in rows]
    times = [None if t.timings.started_at is None or t.timings.finished_at is None
             else t.timings.finished_at - t.timings.started_at for t in trained]
    data: dict[str, Any] = {
        "prompt_token_ids": [s.prompt_ids for s in rows],
        "response_ids": [s.response_ids for s in rows],
        "rewards": [s.reward for s in rows],
        "loss_masks": [s.loss_mask for s in rows],
        "stop_reasons": [stop_reason(s.status) for s in rows],
        "rollout_metrics": _rollout_metrics(trajectories, len(batch.exclusions)),
        "rollout_logprobs": [s.logprobs for s in rows],
        "trajectory_ids": row_ids,
        "trajectory_generation_times": None if None in times else times,
        "rollout_expert_indices": None,
        "is_last_step": [s.is_last_segment for s in rows] if step_wise else None,
        "env_metrics": [{**t.metrics, **{k: v for k, v in t.rewards.items() if v is not None}}
                        for t in trained],
        "pixel_values": None,
        "image_grid_thw": None,
        "rollout_sample_support": None,
        "treadle_policy_versions": [s.policy_versions for s in rows],
    }
    return Converted(data, batch.exclusions)


def _rollout_metrics(trajectories: Sequence[Trajectory], excluded: int) -> dict[str, float]:
    n = max(len(trajectories), 1)
    return {
        "treadle/num_trajectories": float(len(trajectories)),
        "treadle/num_excluded": float(excluded),
        "treadle/num_infra_failures": float(sum(t.infra_failure for t in trajectories)),
        "treadle/mean_llm_s": sum(t.timings.llm_s for t in trajectories) / n,
        "treadle/mean_tool_s": sum(t.timings.tool_s for t in trajectories) / n,
        "treadle/mean_queue_s": sum(t.timings.queue_s for t in trajectories) / n,
    }

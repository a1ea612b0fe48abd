"""TRL: the dict `GRPOTrainer(rollout_func=...)` takes (trl/trainer/grpo_trainer.py).

    def rollout_func(prompts, trainer):
        trajectories = ...                       # run by treadle, one per prompt entry
        ordered = in_group_order(trajectories, group_ids_of(prompts))
        return to_trl(ordered, pad_token_id=tok.pad_token_id).data

    GRPOTrainer(..., rollout_func=rollout_func, reward_funcs=[treadle_reward])

TRL hands `rollout_func` its prompt list (each prompt repeated ``num_generations``
times, consecutively) and wants one completion per entry, in the same order; it
groups rows positionally (``rewards.view(-1, num_generations)``). Keys:

    prompt_ids         list[list[int]]    required by TRL
    completion_ids     list[list[int]]    required: model and tool tokens
    logprobs           list[list[float]]  required: one per completion token
    env_mask           list[list[int]]    1 = sampled by the model; TRL multiplies it
                                          into the loss mask
    treadle_reward     list[float | None] not a TRL key: TRL forwards extra keys to
                                          the reward functions, and `treadle_reward`
                                          (the reward function) returns it
    treadle_policy_versions  list[list[int]]  the policy version that sampled each
                                          completion token (one per logprob; [0] on an
                                          excluded row's placeholder), for an
                                          off-policy correction of `logprobs`
    treadle_rewards    list[dict[str, float | None]]  a rubric's reward vector per row
                                          (`Trajectory.rewards`; {} without a rubric,
                                          and on an excluded row), for reward
                                          functions per dimension
    treadle_trajectory_id, treadle_status, treadle_excluded   per row, for logging

Rewards are treadle's (the environment scored them), so the reward function only
passes them through. Excluded trajectories cannot be dropped (a row per prompt
entry), so they stay masked: ``env_mask`` all 0 and reward None, which TRL treats as
*unscorable* (NaN: left out of the group's mean and std, advantage 0), never as 0.
An excluded trajectory keeps its prompt (or ``[pad_token_id]`` if it has none) and
gets the placeholder completion ``[pad_token_id]``, as TRL reads each completion's
last token. TRL has one completion per prompt entry, so a trajectory with several
segments raises ConversionError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treadle.client.errors import ConversionError
from treadle.client.samples import Converted, training_sequences
from treadle.types import Trajectory

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")  # rollout_func's required keys


def to_trl(trajectories: Sequence[Trajectory], *, pad_token_id: int,
           drop_group_on_failure: bool = False,
           num_generations: int | None = None) -> Converted[dict[str, list[Any]]]:
    """TRL's rollout_func dict, one row per trajectory in input order.

    With `num_generations`, checks that the rows come in consecutive groups of that
    size (what TRL assumes); ConversionError otherwise.
    """
    if num_generations is not None:
        _check_groups(trajectories, num_generations)
    batch = training_sequences(trajectories, drop_failed=False,
                               drop_group_on_failure=drop_group_on_failure)
    data: dict[str, list[Any]] = {key: [] for key in (
        *REQUIRED_KEYS, "env_mask", "treadle_reward", "treadle_policy_versions",
        "treadle_rewards", "treadle_trajectory_id", "treadle_status", "treadle_excluded")}
    by_id = {t.trajectory_id: t for t in trajectories}
    for s in batch.sequences:
        if s.num_segments > 1:
            raise ConversionError(f"trajectory {s.trajectory_id!r} has {s.num_segments} "
                                  f"segments; TRL takes one completion per prompt entry")
        if s.excluded is None:
            prompt, completion, logprobs, mask, versions = (
                s.prompt_ids, s.response_ids, s.logprobs, s.loss_mask, s.policy_versions)
        else:
            prompt = s.prompt_ids or [pad_token_id]
            completion, logprobs, mask, versions = [pad_token_id], [0.0], [0], [0]
        if not completion:
            raise ConversionError(f"trajectory {s.trajectory_id!r} has an empty completion; "
                                  f"TRL needs at least one token")
        data["prompt_ids"].append(prompt)
        data["completion_ids"].append(completion)
        data["logprobs"].append(logprobs)
        data["env_mask"].append(mask)
        data["treadle_reward"].append(s.reward)
        data["treadle_policy_versions"].append(versions)
        data["treadle_rewards"].append(
            {} if s.excluded is not None else dict(by_id[s.trajectory_id].rewards))
        data["treadle_trajectory_id"].append(s.trajectory_id)
        data["treadle_status"].append(s.status.value)
        data["treadle_excluded"].append(s.excluded)
    return Converted(data, batch.exclusions)


def treadle_reward(**kwargs: Any) -> list[float | None]:
    """A TRL reward function returning treadle's rewards (None = unscorable row)."""
    rewards: list[float | None] = list(kwargs["treadle_reward"])
    return rewards


def _check_groups(trajectories: Sequence[Trajectory], n: int) -> None:
    if n < 1 or len(trajectories) % n:
        raise ConversionError(f"{len(trajectories)} trajectories are not groups of "
                              f"num_generations={n}")
    seen: set[str] = set()
    for start in range(0, len(trajectories), n):
        block = {t.key.group_id for t in trajectories[start:start + n]}
        if len(block) != 1 or block & seen:
            raise ConversionError(f"rows {start}..{start + n - 1} (groups "
                                  f"{', '.join(sorted(block))}) are not one whole group; TRL "
                                  f"groups rows by position (see in_group_order)")
        seen |= block

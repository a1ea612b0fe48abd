"""Each converter's output has the shape its trainer's code expects.

The checks mirror the trainers' own code, read from their repositories:
verl `AgentLoopOutput` and `_postprocess` (volcengine/verl b178a3cd,
verl/experimental/agent_loop/agent_loop.py), SkyRL `validate_generator_output` and
the step-wise advantage broadcast (NovaSky-AI/SkyRL a9564572,
skyrl/train/utils/trainer_utils.py, skyrl/train/trainer.py), TRL `_generate` and
the nan-aware group advantages (huggingface/trl f2cd5771,
trl/trainer/grpo_trainer.py). None of the trainers is installed here.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import pytest
from client_helpers import error, traj
from pydantic import BaseModel, ConfigDict

from treadle.client import (
    ConversionError,
    SkyRLTrajectoryID,
    group_advantages,
    to_skyrl,
    to_trl,
    to_verl,
    training_sequences,
    treadle_reward,
)
from treadle.client.skyrl import stop_reason
from treadle.client.verl import plan_step, rows_in_order, step_records
from treadle.types import Trajectory, TrajectoryStatus


class FakeAgentLoopMetrics(BaseModel):
    """verl's AgentLoopMetrics, field for field; extra fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1


class FakeAgentLoopOutput(BaseModel):
    """verl's AgentLoopOutput, field for field; extra fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: FakeAgentLoopMetrics
    extra_fields: dict[str, Any] = {}


def _mixed_batch() -> list[Trajectory]:
    return [traj("a0", "a", 0, 1.0), traj("a1", "a", 1, 0.0, metrics={"exact_match": 0.0,
                                                                       "format": 1.0}),
            traj("a2", "a", 2, 0.5, segments=2), error("a3", "a", 3),
            traj("b0", "b", 0, 0.0, status=TrajectoryStatus.TRUNCATED),
            traj("b1", "b", 1, 1.0), traj("b2", "b", 2, 0.25),
            traj("b3", "b", 3, 0.0, status=TrajectoryStatus.TIMEOUT)]


# -- verl ----------------------------------------------------------------------------


def test_verl_records_validate_as_agent_loop_outputs() -> None:
    out = to_verl(_mixed_batch())
    outputs = [FakeAgentLoopOutput(**record) for record in out.data]
    assert [o.extra_fields["treadle_trajectory_id"] for o in outputs] == \
        ["a0", "a1", "a2", "a2", "b0", "b1", "b2", "b3"]
    for o in outputs:  # what verl's _agent_loop_postprocess pads side by side
        assert len(o.response_ids) == len(o.response_mask) == len(o.response_logprobs or [])
        assert o.reward_score is not None
    # verl reads the first record's reward_extra_info keys for every record.
    keys = [sorted(o.extra_fields["reward_extra_info"]) for o in outputs]
    assert all(k == ["exact_match", "format"] for k in keys)
    assert math.isnan(outputs[0].extra_fields["reward_extra_info"]["format"])
    first = outputs[0]
    assert first.num_turns == 4  # prompt + 2 assistant turns + 1 tool response
    assert first.metrics == FakeAgentLoopMetrics(generate_sequences=1.5, tool_calls=0.25)
    assert [e.trajectory_id for e in out.exclusions] == ["a3"]
    assert outputs[2].extra_fields["treadle_segment_index"] == 0
    assert outputs[3].extra_fields["treadle_num_segments"] == 2


def test_verl_keeps_failures_masked_when_asked() -> None:
    out = to_verl(_mixed_batch(), drop_failed=False)
    failed = [FakeAgentLoopOutput(**r) for r in out.data
              if r["extra_fields"]["treadle_trajectory_id"] == "a3"]
    assert len(failed) == 1
    assert failed[0].reward_score is None and set(failed[0].response_mask) == {0}
    assert failed[0].extra_fields["treadle_excluded"].startswith("infra_failure")


def test_verl_step_plan_is_one_task_per_uid_with_the_rows_repetitions() -> None:
    # verl's batch: each prompt repeated rollout.n times (interleaved), all with one uid;
    # records as dicts or as JSON text (a parquet column).
    record = {"id": "q7", "question": "What is 2 + 2?", "answer": "4"}
    plan = plan_step(["u1", "u1", "u2", "u2"],
                     [record, record, '{"id": "q7", "question": "1 + 1?", "answer": "2"}',
                      '{"id": "q7", "question": "1 + 1?", "answer": "2"}'])
    assert [t["id"] for t in plan.tasks] == ["u1", "u2"]  # ids unique even if a task repeats
    assert plan.tasks[0]["question"] == "What is 2 + 2?" and record["id"] == "q7"
    assert plan.samples_per_task == 2
    assert plan.slots == [("u1", 0), ("u1", 1), ("u2", 0), ("u2", 1)]
    # A validation batch padded to a divisor repeats its first rows: their group samples more.
    padded = plan_step(["u1", "u1", "u2", "u2", "u1"], [record] * 5)
    assert padded.samples_per_task == 3 and padded.slots[-1] == ("u1", 2)
    with pytest.raises(ValueError, match="row 1: uid 'u1' carries a task record other"):
        plan_step(["u1", "u1"], [record, {**record, "answer": "5"}])
    with pytest.raises(ValueError, match="row 0: the task record must be a JSON object"):
        plan_step(["u1"], ["[1, 2]"])
    with pytest.raises(ValueError, match="row 0: the task record is not JSON"):
        plan_step(["u1"], ["{"])


def test_verl_rows_in_order_finds_each_rows_sample_and_skips_sub_agents() -> None:
    plan = plan_step(["u1", "u1", "u2", "u2"], [{"id": "x"}] * 4)
    delivered = [traj("j/u2/1", "j/u2", 1), traj("j/u1/0", "j/u1", 0),
                 traj("j/u1/0/sub/0", "j/u1/sub", 0),  # a sub-agent: its own group
                 traj("j/u2/0", "j/u2", 0), traj("j/u1/1", "j/u1", 1)]
    rows = rows_in_order(plan, "j", delivered)
    assert [t.trajectory_id for t in rows] == ["j/u1/0", "j/u1/1", "j/u2/0", "j/u2/1"]
    with pytest.raises(ConversionError, match=r"no trajectory for row 1 \(uid 'u1', rep"):
        rows_in_order(plan, "j", delivered[:-1])


def test_verl_step_records_a_row_per_segment_and_the_groups_mean_for_the_excluded() -> None:
    rows = [traj("j/u1/0", "j/u1", 0, 1.0, segments=2), traj("j/u1/1", "j/u1", 1, 0.0),
            error("j/u1/2", "j/u1", 2), error("j/u2/0", "j/u2", 0, with_tokens=False)]
    step = step_records(rows)
    assert step.rows == [0, 0, 1, 2, 3]  # the two-segment trajectory: two rows of row 0
    outputs = [FakeAgentLoopOutput(**r) for r in step.records]
    assert [o.reward_score for o in outputs] == [1.0, 1.0, 0.0, 0.5, 0.0]
    # The excluded: no loss, the mean of their group's trained rewards (none: 0.0), so
    # that a GRPO over the rows of a uid keeps the trained members' mean.
    for o in outputs[3:]:
        assert set(o.response_mask) <= {0} and o.extra_fields["treadle_excluded"]
    assert [e.trajectory_id for e in step.exclusions] == ["j/u1/2", "j/u2/0"]
    last = step_records(rows, segments="last")
    assert last.rows == [0, 1, 2, 3]
    assert last.records[0]["extra_fields"]["treadle_segment_index"] == 1
    dropped = step_records(rows, drop_group_on_failure=True)
    assert {r["extra_fields"]["treadle_excluded"] is not None for r in dropped.records} == {True}
    assert [r["reward_score"] for r in dropped.records] == [0.0] * 5


# -- SkyRL ---------------------------------------------------------------------------


def skyrl_validate(num_prompts: int, out: dict[str, Any], step_wise: bool) -> None:
    """SkyRL's validate_generator_output and _validate_step_wise_fields, as assertions."""
    n = len(out["response_ids"])
    assert n > 0
    if not step_wise:
        assert num_prompts == n
    assert n == len(out["prompt_token_ids"])
    for key in ("response_ids", "loss_masks", "rewards", "rollout_logprobs", "stop_reasons",
                "trajectory_ids", "rollout_expert_indices", "is_last_step", "pixel_values",
                "image_grid_thw"):
        if isinstance(out[key], list):
            assert len(out[key]) == n, key
    for i, (ids, mask) in enumerate(zip(out["response_ids"], out["loss_masks"], strict=True)):
        assert len(ids) == len(mask)
        assert len(ids) == len(out["rollout_logprobs"][i])
    assert all(not isinstance(r, list) for r in out["rewards"])
    assert all(isinstance(r, float) for r in out["rewards"])
    if step_wise:
        last, tids = out["is_last_step"], out["trajectory_ids"]
        assert last is not None and tids is not None and last[-1] is True
        keys = [t.to_string() for t in tids]
        seen: set[str] = set()
        for i, key in enumerate(keys):  # contiguous trajectories
            if i and key != keys[i - 1]:
                assert key not in seen
                seen.add(keys[i - 1])
        for i in range(n - 1):  # is_last_step exactly at trajectory boundaries
            assert last[i] == (keys[i] != keys[i + 1])


# The keys of SkyRL's GeneratorOutput TypedDict in skyrl 0.3.0 (the release treadle[skyrl]
# pins), plus rollout_sample_support, a later release's key (None here: its
# validate_generator_output and merge_stepwise_output pass a None through); and the
# keys TRL's rollout_func must return (it raises without them), as those trainers
# define them. tests/trainers/test_trainers_skyrl.py checks the set against SkyRL's own.
SKYRL_GENERATOR_OUTPUT_KEYS = {
    "prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons",
    "rollout_metrics", "rollout_logprobs", "trajectory_ids", "trajectory_generation_times",
    "rollout_expert_indices", "is_last_step", "env_metrics", "pixel_values",
    "image_grid_thw", "rollout_sample_support"}
TRL_ROLLOUT_FUNC_KEYS = {"prompt_ids", "completion_ids", "logprobs"}


def skyrl_step_wise_advantages(out: dict[str, Any]) -> list[float]:
    """SkyRL's step-wise GRPO, written apart from treadle's: (r - mean) / (std + 1e-6)
    over the last rows of each uid (std with n - 1; a one-member group keeps its raw
    reward, as SkyRL's does), broadcast to the trajectory's other rows."""
    last = out["is_last_step"]
    idx = [i for i, x in enumerate(last) if x]
    by_uid: dict[str, list[float]] = {}
    for i in idx:
        by_uid.setdefault(out["trajectory_ids"][i].instance_id, []).append(out["rewards"][i])
    adv = []
    for i in idx:
        rewards = by_uid[out["trajectory_ids"][i].instance_id]
        if len(rewards) == 1:
            adv.append(rewards[0])
            continue
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        adv.append(0.0 if std == 0 else (out["rewards"][i] - mean) / (std + 1e-6))
    traj_of_row, k = [], 0
    for i in range(len(last)):  # cumsum of the shifted is_last_step
        traj_of_row.append(k)
        k += 1 if last[i] else 0
    return [adv[j] for j in traj_of_row]


def test_skyrl_step_wise_output_validates_and_broadcasts_our_advantages() -> None:
    batch = _mixed_batch()
    out = to_skyrl(batch, step_wise=True)
    # SkyRL's keys, and treadle's per-token versions (row-aligned: SkyRL passes it on).
    assert set(out.data) == SKYRL_GENERATOR_OUTPUT_KEYS | {"treadle_policy_versions"}
    skyrl_validate(len(batch), out.data, step_wise=True)
    ours = [s.advantage for s in training_sequences(batch).sequences]
    assert skyrl_step_wise_advantages(out.data) == ours
    assert out.data["stop_reasons"][:1] == ["stop"]
    assert "length" in out.data["stop_reasons"] and "timeout" in out.data["stop_reasons"]
    assert out.data["trajectory_ids"][0] == SkyRLTrajectoryID("a", 0)
    assert out.data["trajectory_ids"][0].to_string() == "a_0"
    assert out.data["trajectory_generation_times"] == [2.5] * 8
    assert out.data["rollout_sample_support"] is None
    assert out.data["rollout_metrics"]["treadle/mean_llm_s"] == 1.5
    assert out.data["rollout_metrics"]["treadle/num_infra_failures"] == 1.0
    assert [e.trajectory_id for e in out.exclusions] == ["a3"]


def test_skyrl_plain_mode_is_one_row_per_prompt() -> None:
    batch = [traj("a0", "a", 0, 1.0), traj("a1", "a", 1, 0.0), traj("b0", "b", 0, 0.5)]
    out = to_skyrl(batch, trajectory_id_type=lambda g, r: (g, r))
    skyrl_validate(len(batch), out.data, step_wise=False)
    assert out.data["is_last_step"] is None
    assert out.data["trajectory_ids"] == [("a", 0), ("a", 1), ("b", 0)]
    with pytest.raises(ConversionError, match="step_wise=True"):
        to_skyrl([*batch, error("b1", "b", 1)])
    with pytest.raises(ConversionError, match="several segments"):
        to_skyrl([traj("a0", "a", 0, 1.0, segments=2)])
    with pytest.raises(ConversionError, match="no trajectory to train"):
        to_skyrl([error("a0", "a", 0)], step_wise=True)


def test_skyrl_rows_carry_the_ids_skyrl_sent() -> None:
    # SkyRL groups rows by trajectory_ids[i].instance_id: its uid, not treadle's group id.
    batch = [traj("j/q7/0", "j/q7", 0, 1.0, segments=2), traj("j/q7/1", "j/q7", 1, 0.0),
             error("j/q7/2", "j/q7", 2)]
    sent = {"j/q7/0": SkyRLTrajectoryID("7", 1), "j/q7/1": SkyRLTrajectoryID("7", 0),
            "j/q7/2": SkyRLTrajectoryID("7", 2)}
    out = to_skyrl(batch, step_wise=True, trajectory_ids=sent)
    skyrl_validate(len(batch), out.data, step_wise=True)
    assert [t is sent[tid] for t, tid in zip(out.data["trajectory_ids"],
                                             ["j/q7/0", "j/q7/0", "j/q7/1"],
                                             strict=True)] == [True] * 3
    with pytest.raises(ConversionError, match="no SkyRL trajectory id"):
        to_skyrl(batch[:2], trajectory_ids={"j/q7/0": sent["j/q7/0"]}, step_wise=True)
    # One that is left out needs none.
    to_skyrl(batch, step_wise=True, trajectory_ids={k: sent[k] for k in ("j/q7/0", "j/q7/1")})


def test_skyrl_stop_reasons() -> None:
    assert [stop_reason(s) for s in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED,
                                     TrajectoryStatus.MAX_TURNS, TrajectoryStatus.TIMEOUT)] == \
        ["stop", "length", "max_turns", "timeout"]


# -- TRL -----------------------------------------------------------------------------


def trl_advantages(rewards: list[float | None], num_generations: int) -> list[float]:
    """TRL's sum_then_normalize with scale_rewards="group": nan-aware, 1e-4, NaN -> 0."""
    out: list[float] = []
    for start in range(0, len(rewards), num_generations):
        block = rewards[start:start + num_generations]
        scored = [r for r in block if r is not None]
        mean = statistics.fmean(scored)
        std = statistics.stdev(scored) if len(scored) > 1 else math.nan
        out += [0.0 if r is None or math.isnan(std) else (r - mean) / (std + 1e-4)
                for r in block]
    return out


def test_trl_dict_has_one_row_per_prompt_entry() -> None:
    batch = [traj("a0", "a", 0, 1.0), error("a1", "a", 1), traj("a2", "a", 2, 0.0),
             traj("a3", "a", 3, 0.5), traj("b0", "b", 0, 0.0),
             error("b1", "b", 1, with_tokens=False), traj("b2", "b", 2, 1.0),
             traj("b3", "b", 3, 0.25)]
    prompts = ["pa"] * 4 + ["pb"] * 4  # what TRL hands rollout_func
    out = to_trl(batch, pad_token_id=0, num_generations=4)
    data = out.data
    assert set(data) >= TRL_ROLLOUT_FUNC_KEYS  # TRL raises without them
    assert all(len(data[k]) == len(prompts) for k in data)
    for ids, lp, mask in zip(data["completion_ids"], data["logprobs"], data["env_mask"],
                             strict=True):
        assert ids and len(lp) == len(ids) == len(mask)  # TRL reads ids[-1]
    assert data["env_mask"][1] == [0] and data["completion_ids"][5] == [0]
    assert data["prompt_ids"][1] == batch[1].segments[0].prompt_ids
    assert data["prompt_ids"][5] == [0]
    rewards = treadle_reward(prompts=prompts, completions=[], completion_ids=[],
                             treadle_reward=data["treadle_reward"], trainer_state=None)
    assert rewards[1] is None and rewards[5] is None
    # TRL's nan-aware baseline over the scored rows = our baseline over trained rows.
    trained = [t for t in batch if not t.infra_failure]
    ours = group_advantages([t.reward or 0.0 for t in trained],
                            [t.key.group_id for t in trained], epsilon=1e-4)
    expected = iter(ours)
    assert trl_advantages(rewards, 4) == pytest.approx(
        [0.0 if t.infra_failure else next(expected) for t in batch], rel=1e-12)
    assert [e.trajectory_id for e in out.exclusions] == ["a1", "b1"]


def test_trl_refusals() -> None:
    batch = [traj("a0", "a", 0), traj("b0", "b", 0), traj("a1", "a", 1), traj("b1", "b", 1)]
    with pytest.raises(ConversionError, match="not one whole group"):
        to_trl(batch, pad_token_id=0, num_generations=2)
    with pytest.raises(ConversionError, match="not groups of"):
        to_trl(batch[:3], pad_token_id=0, num_generations=2)
    with pytest.raises(ConversionError, match="one completion per prompt"):
        to_trl([traj("a0", "a", 0, segments=2)], pad_token_id=0)
    empty = traj("a0", "a", 0)
    empty.segments[0].response_ids = []
    empty.segments[0].loss_mask = []
    empty.segments[0].logprobs = []
    empty.segments[0].policy_versions = []
    with pytest.raises(ConversionError, match="empty completion"):
        to_trl([empty], pad_token_id=0)
    group_drop = to_trl([traj("a0", "a", 0), error("a1", "a", 1)], pad_token_id=0,
                        drop_group_on_failure=True)
    assert group_drop.data["treadle_reward"] == [None, None]
    assert group_drop.data["env_mask"] == [[0], [0]]


# -- the rule every converter keeps --------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_an_error_never_appears_with_reward_zero(seed: int) -> None:
    rng = random.Random(seed)
    batch = []
    for g in range(4):
        for r in range(4):
            if rng.random() < 0.3:
                batch.append(error(f"g{g}r{r}", f"g{g}", r, with_tokens=rng.random() < 0.5))
            else:
                batch.append(traj(f"g{g}r{r}", f"g{g}", r, rng.choice([0.0, 1.0, 0.5]),
                                  status=rng.choice([TrajectoryStatus.COMPLETED,
                                                     TrajectoryStatus.TRUNCATED])))
    failed = {t.trajectory_id for t in batch if t.infra_failure}
    for drop_group in (False, True):
        for drop_failed in (True, False):
            for s in training_sequences(batch, drop_failed=drop_failed,
                                        drop_group_on_failure=drop_group).sequences:
                if s.trajectory_id in failed:
                    assert s.reward is None and s.advantage is None and 1 not in s.loss_mask
            for r in to_verl(batch, drop_failed=drop_failed,
                             drop_group_on_failure=drop_group).data:
                if r["extra_fields"]["treadle_trajectory_id"] in failed:
                    assert not drop_failed
                    assert r["reward_score"] is None and 1 not in r["response_mask"]
        trl = to_trl(batch, pad_token_id=0, drop_group_on_failure=drop_group).data
        for tid, reward, mask in zip(trl["treadle_trajectory_id"], trl["treadle_reward"],
                                     trl["env_mask"], strict=True):
            if tid in failed:
                assert reward is None and 1 not in mask
        trainable = training_sequences(batch, drop_group_on_failure=drop_group).sequences
        if not trainable:  # SkyRL refuses an empty batch rather than get one
            with pytest.raises(ConversionError):
                to_skyrl(batch, step_wise=True, drop_group_on_failure=drop_group)
            continue
        sky = to_skyrl(batch, step_wise=True, drop_group_on_failure=drop_group).data
        ids = {f"{t.instance_id}_{t.repetition_id}" for t in sky["trajectory_ids"]}
        assert not ids & {f"{t.key.group_id}_{t.key.repetition}" for t in batch
                          if t.infra_failure}


# -- frozen sub-agents ---------------------------------------------------------------


def _frozen(tid: str, group: str, rep: int) -> Trajectory:
    """A frozen sub-agent of p0: all tokens at mask 0, unscored."""
    t = traj(tid, group, rep, None)
    t.trainable, t.parent_id = False, "p0"
    for seg in t.segments:
        seg.loss_mask = [0] * len(seg.response_ids)
        seg.logprobs = [0.0] * len(seg.response_ids)
    return t


def _with_frozen_and_aborted() -> list[Trajectory]:
    return [traj("a0", "a", 0, 1.0), _frozen("a1", "a", 1), traj("a2", "a", 2, 0.0),
            traj("a3", "a", 3, None, status=TrajectoryStatus.ABORTED)]


def test_verl_treats_a_frozen_sub_agent_as_it_treats_an_aborted_one() -> None:
    batch = _with_frozen_and_aborted()
    out = to_verl(batch)
    assert [r["extra_fields"]["treadle_trajectory_id"] for r in out.data] == ["a0", "a2"]
    assert [(e.trajectory_id, e.reason) for e in out.exclusions] == [
        ("a1", "frozen sub-agent (of p0)"), ("a3", "aborted: aborted")]
    kept = [FakeAgentLoopOutput(**r) for r in to_verl(batch, drop_failed=False).data]
    by_id = {o.extra_fields["treadle_trajectory_id"]: o for o in kept}
    for tid in ("a1", "a3"):
        assert by_id[tid].reward_score is None and set(by_id[tid].response_mask) == {0}
    assert by_id["a1"].extra_fields["treadle_excluded"] == "frozen sub-agent (of p0)"
    assert to_verl(batch, drop_group_on_failure=True).data == []  # the abort drops it
    alone = to_verl([batch[0], batch[1], batch[2]], drop_group_on_failure=True)
    assert [r["extra_fields"]["treadle_trajectory_id"] for r in alone.data] == ["a0", "a2"]


def test_skyrl_drops_a_frozen_sub_agent_step_wise_and_refuses_it_plain() -> None:
    batch = [traj("a0", "a", 0, 1.0), _frozen("a1", "a", 1), traj("a2", "a", 2, 0.0)]
    out = to_skyrl(batch, step_wise=True, drop_group_on_failure=True)
    skyrl_validate(len(batch), out.data, step_wise=True)
    assert out.data["trajectory_ids"] == [SkyRLTrajectoryID("a", 0), SkyRLTrajectoryID("a", 2)]
    assert skyrl_step_wise_advantages(out.data) == \
        [s.advantage for s in training_sequences([batch[0], batch[2]]).sequences]
    assert out.data["rollout_metrics"]["treadle/num_excluded"] == 1.0
    assert out.data["rollout_metrics"]["treadle/num_infra_failures"] == 0.0
    with pytest.raises(ConversionError, match="step_wise=True"):
        to_skyrl(batch)  # as for an aborted one: a row per prompt is impossible
    with pytest.raises(ConversionError, match="no trajectory to train"):
        to_skyrl([_frozen("s0", "sub", 0), _frozen("s1", "sub", 1)], step_wise=True)


def test_trl_keeps_a_frozen_sub_agent_masked_and_unscored() -> None:
    batch = _with_frozen_and_aborted()
    out = to_trl(batch, pad_token_id=0, num_generations=4)
    data = out.data
    assert data["treadle_trajectory_id"] == ["a0", "a1", "a2", "a3"]
    for i in (1, 3):  # the frozen and the aborted row look alike
        assert data["env_mask"][i] == [0] and data["completion_ids"][i] == [0]
        assert data["treadle_reward"][i] is None
    assert data["prompt_ids"][1] == batch[1].segments[0].prompt_ids
    assert data["treadle_excluded"][1] == "frozen sub-agent (of p0)"
    # TRL leaves unscored rows out of the group's mean and std: the baseline is a0, a2.
    adv = group_advantages([1.0, 0.0], ["a", "a"], epsilon=1e-4)
    rewards = treadle_reward(treadle_reward=data["treadle_reward"])
    assert trl_advantages(rewards, 4) == pytest.approx([adv[0], 0.0, adv[1], 0.0], rel=1e-12)

"""The verl side of tests/trainers/test_trainers_verl.py, run with verl's virtualenv
(.venv-verl: verl 0.9.1, CPU torch) against a treadle service the test started:

    .venv-verl/bin/python tests/trainers/verl_script.py SPEC.json REPORT.json

SPEC: {url, model_dir, weights_dir, work_dir, overrides (the docs' verl overrides,
with the test's values), docs_python (the docs' dataset snippet), harness, n}.
It does what verl's RayPPOTrainer does around the rollout manager, with verl's own
code wherever verl has it (config composition, RLHFDataset, `_get_gen_batch`,
`repeat`, `union`, `compute_advantage`, the policy loss), and checks the manager's
output with verl's own checks and against verl's own `AgentLoopWorker` batching of
records built from the job's trajectories by verl_expected.py (never by treadle's
converter, the code under test). Every check is an assert; the findings go to REPORT
as JSON, with each row of the manager's batch for the test to compare with its
engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import verl
from hydra import compose, initialize_config_dir
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, AgentLoopWorker
from verl.protocol import DataProto, _deep_equal
from verl.trainer.ppo.core_algos import AdvantageEstimator, get_policy_loss_fn
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
from verl.trainer.ppo.reward import extract_reward
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.dataset.rl_dataset import collate_fn
from verl.utils.torch_functional import logprobs_from_logits
from verl_expected import expected_records, wire_records

from treadle.client import RolloutClient
from treadle.client.verl_manager import (
    TreadleAgentLoopManager,
    TreadleCheckpointManager,
    version_dir,
)

REPORT: dict[str, Any] = {}


def compose_config(overrides: list[str]) -> Any:
    """verl's ppo_trainer config with `overrides`, as `python -m verl.trainer.main_ppo`
    composes it."""
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def step_batch(config: Any, global_steps: int) -> tuple[DataProto, DataProto]:
    """(the trainer's batch, the batch it hands the rollout manager) for the dataset's
    rows, built as `RayPPOTrainer.fit` builds them."""
    from verl.trainer.ppo.utils import create_rl_dataset

    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    dataset = create_rl_dataset(config.data.train_files, config.data, model.tokenizer,
                                model.processor)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    batch.meta_info["temperature"] = config.actor_rollout_ref.rollout.temperature
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))],
                                             dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # uses nothing of the trainer
    gen_batch.meta_info["global_steps"] = global_steps
    return batch, gen_batch.repeat(repeat_times=config.actor_rollout_ref.rollout.n,
                                   interleave=True)


def verl_reference(config: Any, records: list[dict[str, Any]], rows: list[int],
                   inputs: dict[str, np.ndarray]) -> DataProto:
    """verl's own batching of `records` (AgentLoopOutputs), as its agent loop worker
    does after `run()`: `_agent_loop_postprocess` per output, then `_postprocess`,
    with the worker's tokenizer and lengths (no reward workers, no teacher)."""
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    worker.config = config
    worker.rollout_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    worker.tokenizer, worker.processor = model.tokenizer, model.processor
    worker.mm_processor_kwargs = {}
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False

    async def padded() -> list[Any]:
        out = []
        for record, row in zip(records, rows, strict=True):
            kwargs = {k: v[row] for k, v in inputs.items()}
            out.append(await worker._agent_loop_postprocess(
                AgentLoopOutput(**record), False, **kwargs))
        return out

    where = np.asarray(rows)
    return worker._postprocess(asyncio.run(padded()),
                               input_non_tensor_batch={k: v[where] for k, v in inputs.items()})


def check_against_verl(config: Any, manager: TreadleAgentLoopManager, gen: DataProto,
                       out: DataProto, segments: str) -> dict[str, Any]:
    """The manager's output is verl's own batching of the same trajectories."""
    out.check_consistency()
    P = config.actor_rollout_ref.rollout.prompt_length
    R = config.actor_rollout_ref.rollout.response_length
    n = len(out)
    assert out.batch["prompts"].shape == (n, P) and out.batch["responses"].shape == (n, R)
    assert out.batch["input_ids"].shape == out.batch["attention_mask"].shape == (n, P + R)
    # The same trajectories, fetched again as plain JSON and turned into records here,
    # without treadle's converter (verl_expected.py), then batched by verl's own code.
    inputs = {k: v for k, v in gen.non_tensor_batch.items()}
    uids = [str(u) for u in inputs["uid"]]
    job_id = manager.last_job_id
    assert job_id is not None
    trajectories = wire_records(manager.settings.url, os.environ.get("TREADLE_TOKEN"), job_id)
    records, rows = expected_records(job_id, uids, trajectories, segments, R)
    for record in records:
        AgentLoopOutput(**record)  # verl's pydantic model validates every record
    ref = verl_reference(config, records, rows, inputs)
    assert set(out.batch.keys()) == set(ref.batch.keys()), (out.batch.keys(), ref.batch.keys())
    for key in ref.batch.keys():  # noqa: SIM118 (a TensorDict iterates over rows)
        assert out.batch[key].dtype == ref.batch[key].dtype, key
        assert torch.equal(out.batch[key], ref.batch[key]), key
    ours, theirs = set(out.non_tensor_batch), set(ref.non_tensor_batch)
    assert theirs <= ours, theirs - ours
    # Where verl's LLM client would report the weights versions, treadle does.
    assert ours - theirs == set(), ours - theirs
    for key in theirs - {"min_global_steps", "max_global_steps"}:
        assert _deep_equal(out.non_tensor_batch[key], ref.non_tensor_batch[key], set()), key
    for i, r in enumerate(records):
        versions = [v for v, m in zip(r["extra_fields"]["treadle_policy_versions"],
                                      r["response_mask"], strict=True) if m]
        assert out.non_tensor_batch["min_global_steps"][i] == (min(versions) if versions
                                                               else None)
    assert out.meta_info["reward_extra_keys"] == ref.meta_info["reward_extra_keys"]
    timing = out.meta_info["timing"]
    assert {f"agent_loop/{k}/{s}" for k in ("generate_sequences", "tool_calls", "compute_score",
                                            "num_preempted") for s in ("min", "max", "mean")
            } <= set(timing)
    segments_of = [int(s) for s in out.non_tensor_batch["treadle_num_segments"]]
    by_trajectory: dict[str, set[str]] = {}
    for t, u in zip(out.non_tensor_batch["treadle_trajectory_id"],
                    out.non_tensor_batch["uid"], strict=True):
        by_trajectory.setdefault(str(t), set()).add(str(u))
    return {"rows_in": len(gen), "rows_out": n, "max_segments": max(segments_of),
            "uids_per_trajectory": max(len(u) for u in by_trajectory.values()),
            "rows_per_trajectory": max(
                list(out.non_tensor_batch["treadle_trajectory_id"]).count(t)
                for t in by_trajectory),
            "excluded": sorted({str(x) for x in out.non_tensor_batch["treadle_excluded"]
                                if x is not None}),
            "rewards": sorted({float(x) for x in out.batch["rm_scores"].sum(-1)}),
            "rows": batch_rows(out, P)}


def batch_rows(out: DataProto, P: int) -> list[dict[str, Any]]:
    """Each row of the manager's batch with its padding taken off, for the test to
    compare with what its scripted engine was sent and sampled."""
    rows = []
    for i in range(len(out)):
        attention = out.batch["attention_mask"][i].bool()
        kept = attention[P:]
        rows.append({
            "trajectory_id": str(out.non_tensor_batch["treadle_trajectory_id"][i]),
            "prompt_ids": out.batch["prompts"][i][attention[:P]].tolist(),
            "response_ids": out.batch["responses"][i][kept].tolist(),
            "response_mask": out.batch["response_mask"][i][kept].tolist(),
            "rollout_log_probs": out.batch["rollout_log_probs"][i][kept].tolist(),
            "reward": float(out.batch["rm_scores"][i].sum()),
            "excluded": out.non_tensor_batch["treadle_excluded"][i] is not None})
    return rows


def union_as_fit(config: Any, batch: DataProto, out: DataProto) -> DataProto:
    """`RayPPOTrainer.fit`'s join of its batch and the rollout (ray_trainer.py)."""
    joined = batch.repeat(repeat_times=config.actor_rollout_ref.rollout.n, interleave=True)
    return joined.union(out)


def training_step(config: Any, batch: DataProto) -> dict[str, Any]:
    """What fit does on the driver after the rollout (rewards, GRPO advantages), then a
    policy update with verl's loss on a CPU copy of the model: bypass mode (old
    logprobs = the rollout's), `loss_agg_mode` and clipping from verl's actor config."""
    reward_tensor, extra = extract_reward(batch)
    batch.batch["token_level_scores"] = reward_tensor
    if extra:
        batch.non_tensor_batch.update({k: np.array(v) for k, v in extra.items()})
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO,
                              num_repeat=config.actor_rollout_ref.rollout.n,
                              norm_adv_by_std_in_grpo=True, config=config.algorithm)
    advantages = batch.batch["advantages"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    R = batch.batch["responses"].shape[1]
    logits = model(input_ids=batch.batch["input_ids"],
                   attention_mask=batch.batch["attention_mask"],
                   position_ids=batch.batch["position_ids"]).logits
    log_prob = logprobs_from_logits(logits[:, -R - 1:-1], batch.batch["responses"])
    mask = batch.batch["response_mask"].bool()
    gap = (log_prob.detach() - batch.batch["rollout_log_probs"]).abs()[mask]
    policy_loss = get_policy_loss_fn(actor.policy_loss.get("loss_mode", "vanilla"))
    loss, _ = policy_loss(old_log_prob=batch.batch["rollout_log_probs"], log_prob=log_prob,
                          advantages=advantages, response_mask=mask,
                          loss_agg_mode=actor.loss_agg_mode, config=actor)
    loss.backward()
    optimizer.step()
    moved = sum(int(not torch.equal(before[k], v)) for k, v in model.state_dict().items())
    return {"loss": float(loss), "nonzero_advantages": int((advantages.abs() > 0).sum()),
            "params_changed": moved, "logprob_gap_max": float(gap.max()) if gap.numel() else 0.0}


class ActorGroup:
    """Stands for verl's actor worker group, whose `ActorRolloutRefWorker` cannot start
    on a CPU machine (`verl_worker_on_cpu`): its ``update_weights(global_steps, mode)``
    for a backend other than "naive" is ``checkpoint_engine.send_weights(
    engine.get_per_tensor_param())`` (engine_workers.py), here with the model's state
    dict (HF names, as verl's FSDP engine gives them) and the checkpoint engine built
    as the worker builds it (``CheckpointEngineRegistry.new(backend, is_master=...,
    bucket_size=..., **engine_kwargs[backend])``)."""

    def __init__(self, config: Any, model: Any) -> None:
        from verl.checkpoint_engine import CheckpointEngineRegistry

        ce = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
        self.engine = CheckpointEngineRegistry.new(
            ce.backend, is_master=True, bucket_size=ce.update_weights_bucket_megabytes << 20,
            **ce.engine_kwargs.get(ce.backend, {}))
        self.model = model
        self.calls: list[tuple[int, str]] = []

    def update_weights(self, global_steps: int, mode: str = "auto") -> list[Any]:
        self.calls.append((global_steps, mode))
        return [asyncio.run(self.engine.send_weights(iter(self.model.state_dict().items()),
                                                     global_steps=global_steps))]


def push_weights(config: Any, version: int, url: str) -> dict[str, Any]:
    """TreadleCheckpointManager.update_weights(version) with a changed model: the
    directory it wrote, as safetensors and as a Hugging Face checkpoint, and the
    service's policy version after the barrier."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * version)
    group = ActorGroup(config, model)
    ce = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    manager = TreadleCheckpointManager(config=ce, actor_wg=group, replicas=[])
    manager.sleep_replicas()  # what the trainer calls at start: no replica here to sleep
    metrics = manager.update_weights(version)
    again = manager.update_weights(version)  # fit's validation may push a step twice
    path = version_dir(ce.engine_kwargs["treadle"]["weights_dir"], version)
    files = sorted(p.name for p in path.iterdir())
    saved: dict[str, torch.Tensor] = {}
    for f in path.glob("*.safetensors"):
        saved.update(load_file(f))
    expected = model.state_dict()
    assert set(saved) == set(expected), set(saved) ^ set(expected)
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(loaded.state_dict()[k], expected[k]) for k in expected)
    with RolloutClient(url, token=os.environ.get("TREADLE_TOKEN")) as client:
        state = client.weights()
    return {"path": str(path), "files": files, "worker_calls": group.calls,
            "metrics": metrics, "pushed_again": again,
            "service_policy_version": state.policy_version,
            "kept": sorted(p.name for p in path.parent.iterdir())}


def refusals(base: list[str]) -> dict[str, str]:
    """What the adapter refuses, and how it says so."""
    from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: F401 (registers)

    out: dict[str, str] = {}

    def said(name: str, overrides: list[str], go: Any) -> None:
        try:
            go(compose_config([*base, *overrides]))
            out[name] = "accepted"
        except (ValueError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    said("v1_trainer", ["trainer.use_v1=True"],
         lambda c: TreadleAgentLoopManager.create(config=c))
    said("no_suite", ["~actor_rollout_ref.rollout.custom.treadle.suite"],
         lambda c: TreadleAgentLoopManager.create(config=c))
    said("typo", ["+actor_rollout_ref.rollout.custom.treadle.segmnets=last"],
         lambda c: TreadleAgentLoopManager.create(config=c))
    said("naive_backend", ["actor_rollout_ref.rollout.checkpoint_engine.backend=naive"],
         lambda c: TreadleCheckpointManager(config=omega_conf_to_dataclass(
             c.actor_rollout_ref.rollout.checkpoint_engine), actor_wg=None, replicas=[]))

    def too_long(c: Any) -> None:  # treadle's rendered prompt is longer than verl's
        manager = TreadleAgentLoopManager.create(config=c)
        try:
            manager.generate_sequences(step_batch(c, global_steps=6)[1])
        finally:
            out["too_long_job"] = manager.client.job(manager.last_job_id).status
            manager.close()
    said("prompt_too_long", ["data.max_prompt_length=64"], too_long)
    return out


def verl_worker_on_cpu(config: Any) -> str:
    """verl's own actor worker on this CPU machine, as far as it gets: the error that
    stops it, and where (the last frames)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    try:
        worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
        worker.init_model()
    except BaseException as e:  # what stops it is the finding
        frames = traceback.extract_tb(e.__traceback__)
        # verl's own frames (where it decides), then the one that raised.
        shown = [f for f in frames if f"{os.sep}verl{os.sep}" in f.filename][-3:] + frames[-1:]
        where = "; ".join(f"{f.filename.split('site-packages' + os.sep)[-1]}:{f.lineno} "
                          f"{f.name}" for f in shown)
        return f"{type(e).__name__}: {e} [at {where}]"
    return "ran"


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.chdir(spec["work_dir"])
    import pandas as pd

    pd.DataFrame(spec["rows"]).to_parquet("gsm8k/train.parquet")
    exec(spec["docs_python"], {})  # the docs' dataset snippet, on that parquet
    base = spec["overrides"]
    # 1. The docs' configuration (the agent loop, no harness): rows one to one, fit's
    #    join, advantages and a policy update.
    config = compose_config(base)
    batch, gen = step_batch(config, global_steps=1)
    manager = TreadleAgentLoopManager.create(config=config, llm_client=None,
                                             teacher_client=None,
                                             reward_loop_worker_handles=None)
    out = manager.generate_sequences(gen)
    REPORT["agent_loop"] = check_against_verl(config, manager, gen, out, "all")
    REPORT["agent_loop"]["min_policy_version"] = manager.client.job(
        manager.last_job_id).min_policy_version
    joined = union_as_fit(config, batch, out)
    REPORT["training_step"] = training_step(config, joined)
    manager.close()
    # 2. A harness that edits its context: a trajectory with two segments gives two
    #    rows with its uid ("all"), which fit's join refuses; "last" joins.
    for segments in ("all", "last"):
        config = compose_config([*base, f"+actor_rollout_ref.rollout.custom.treadle.harness="
                                 f"{spec['harness']}",
                                 f"+actor_rollout_ref.rollout.custom.treadle.segments={segments}"])
        batch, gen = step_batch(config, global_steps=2)
        manager = TreadleAgentLoopManager.create(config=config)
        out = manager.generate_sequences(gen)
        REPORT[f"harness_{segments}"] = check_against_verl(config, manager, gen, out, segments)
        try:
            union_as_fit(config, batch, out)
            REPORT[f"harness_{segments}"]["fit_union"] = "ok"
        except AssertionError as e:
            REPORT[f"harness_{segments}"]["fit_union"] = f"AssertionError: {e}"
        manager.close()
    # 3. Weights: two pushes (one file, then shards), then a job that must wait for
    #    the version pushed.
    config = compose_config(base)
    REPORT["push_3"] = push_weights(config, 3, spec["url"])
    config = compose_config([*base, "+actor_rollout_ref.rollout.checkpoint_engine."
                             "engine_kwargs.treadle.max_shard_bytes=2000000"])
    REPORT["push_4"] = push_weights(config, 4, spec["url"])
    batch, gen = step_batch(config, global_steps=5)
    manager = TreadleAgentLoopManager.create(config=config)
    out = manager.generate_sequences(gen)
    REPORT["after_push"] = {
        "min_policy_version": manager.client.job(manager.last_job_id).min_policy_version,
        "token_versions": sorted({int(v) for v in out.non_tensor_batch["max_global_steps"]
                                  if v is not None})}
    manager.close()
    REPORT["refusals"] = refusals(base)
    REPORT["verl_worker_on_cpu"] = verl_worker_on_cpu(config)
    Path(sys.argv[2]).write_text(json.dumps(REPORT, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TRL's real GRPOTrainer (trl 1.16.0, in .venv-trl) two steps on rollouts from a
treadle service in front of a real vLLM (CPU build) serving the small trained
model, through the shipped adapter (`treadle.client.trl_trainer`), as docs/trainers.md's
TRL example writes it (`trl_script.py` executes that example): the weights are
pushed after each step as that step's version of the trainer run, each job samples
on exactly that version, and the logprob gap between the trainer's recomputed
logprobs and the engine's is logged (and reported to the job) under 1e-3."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from service.service_helpers import running_service
from trainers.trainers_helpers import trainer_python
from treadle.client import RolloutClient
from treadle.sandbox.registry import get_backend
from treadle.service.schemas import EngineRequest
from treadle.service.state import ServiceConfig
from treadle.train.serving import untied_copy
from treadle.train.transcripts import math_suite, train_tasks
from vllm_server import serve_vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKEN = "trl-token"
HERE = Path(__file__).resolve().parent


def test_grpo_trainer_trains_two_steps_on_treadles_rollouts_on_policy(
        tmp_path: Path, trained_checkpoint: Path) -> None:
    python = trainer_python("trl")
    policy = untied_copy(trained_checkpoint, tmp_path / "policy")
    suite = math_suite()  # the kinds the small model was trained on
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(suite.task_to_record(t)) + "\n"
                             for t in train_tasks(16, seed=77)))
    with serve_vllm(policy, tmp_path, extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as vllm, \
            running_service(ServiceConfig(
                db=str(tmp_path / "s.db"), token=TOKEN, policy="verl",
                engines=[EngineRequest(url=vllm.url, model=vllm.model)],
                tokenizer=str(policy), sandbox=get_backend("local"))) as url:
        env = {**os.environ, "TREADLE_URL": url, "TREADLE_TOKEN": TOKEN,
               "TREADLE_MODEL": str(policy), "TREADLE_TASKS": str(tasks),
               "TRL_EXPERIMENTAL_SILENCE": "1"}
        done = subprocess.run([str(python), str(HERE / "trl_script.py")], env=env,
                              cwd=tmp_path, capture_output=True, text=True, check=False,
                              timeout=540)
        assert done.returncode == 0, done.stderr[-6000:]
        result = json.loads((tmp_path / "result.json").read_text())
        with RolloutClient(url, token=TOKEN) as client:
            last = client.job(result["last_job"])
            trajs = [d.trajectory for d in client.trajectories(result["last_job"])]
    assert result["pushed"] == [0, 1, 2]  # at the start and after each optimiser step
    assert result["served"] == [2, "my-run-1"]
    steps = [row for row in result["log_history"] if "treadle/logprob_gap_max" in row]
    assert len(steps) == 2
    assert all(row["treadle/logprob_gap_max"] < 1e-3 for row in steps), steps
    # The second step's job sampled on exactly version 1 of this run.
    assert (last.min_policy_version, last.max_policy_version, last.trainer_run) == (
        1, 1, "my-run-1")
    assert last.trainer_metrics["logprob_gap_max"] < 1e-3
    assert {v for t in trajs for s in t.segments
            for v, m in zip(s.policy_versions, s.loss_mask, strict=True) if m} == {1}
    assert len(trajs) == 8

"""Two GRPO steps end to end, asynchronously: rollouts from the treadle service on a
real vLLM engine (CPU build), a policy-gradient step while the next step's rollouts
run, the weights pushed through the weight-update barrier with the `keep` mode; the
weights change, the policy version advances, the next step trains on tokens of both
versions within the bound, and the engine's logprobs stay the trainer's on each
version. (The synchronous loop is this one with the bound at 0: `StepJobs` is tested
for both in test_train_grpo_step.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.agent.tokenizer import HFTokenizer
from treadle.demo import DEMO_SFT_STEPS
from treadle.train.grpo import GRPOConfig, train_grpo
from treadle.train.model import load_model, weights_digest
from treadle.train.plot import plot_report
from treadle.train.sft import SFTConfig
from vllm_server import ensure_vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_rl_steps_change_the_weights_and_advance_the_policy_version(
        tmp_path: Path, trained_checkpoint: Path) -> None:
    # The checkpoint gets about 15% right at T=1.0: a group of 4 has mixed rewards
    # about half the time, so 16 groups without one would be a 1-in-30,000 event.
    config = GRPOConfig(sft=SFTConfig(steps=DEMO_SFT_STEPS), prompts_per_step=8,
                        group_size=4, max_steps=2, eval_every=1000, eval_tasks=4,
                        sandbox="local", vllm_python=str(ensure_vllm()), max_staleness=1)
    out = tmp_path / "rl"
    report = train_grpo(config, out, cache_root=trained_checkpoint.parent,
                        log=lambda _m: None)
    assert [s.policy_version for s in report.steps] == [0, 1]  # each step's own rollouts
    assert all(s.trajectories == 32 and s.excluded == 0 for s in report.steps)
    assert sum(s.trained for s in report.steps) > 0, "no group with mixed rewards"
    # Read from the trajectories' tool calls: this checkpoint calls python in ~95%.
    assert all(0.5 < s.tool_use <= 1.0 for s in report.steps)
    first, last = report.evals
    assert (first.policy_version, first.versions) == (0, [0])
    assert (last.policy_version, last.versions) == (2, [2])  # the new weights sampled them
    # The engine's logprobs are the trainer's on the same weights, update after update.
    assert all(s.logprob_gap_max < 1e-3 for s in report.steps)
    # Step 1's job was submitted as step 0 started: its first turns were sampled on
    # version 0 before step 0's update, so step 1 trains on stale tokens (bound 1).
    assert report.steps[0].staleness_max == 0 and report.steps[0].stale_tokens == 0
    assert report.steps[1].staleness_max == 1 and report.steps[1].stale_tokens > 0
    assert report.steps[1].stale_gap_mean > 0  # the policy moved since they were sampled
    v0, v2 = load_model(out / "weights" / "v0"), load_model(out / "weights" / "v2")
    assert weights_digest(v0) != weights_digest(v2)
    # Each pushed version is a whole checkpoint: its tokenizer is the start's.
    assert (HFTokenizer(out / "weights" / "v2").encode("print(3 ** 40 % 7)")
            == HFTokenizer(out / "weights" / "v0").encode("print(3 ** 40 % 7)"))
    saved = json.loads((out / "rl.json").read_text())
    assert saved["summary"]["final_policy_version"] == 2 and len(saved["steps"]) == 2
    assert plot_report(saved, tmp_path / "rl.png").stat().st_size > 10_000

"""GRPO on the small model, with every rollout served by treadle: the end-to-end RL loop.

    report = train_grpo(GRPOConfig(), Path("out/rl"), cache_root=Path("~/.cache/treadle"))

One run:

1. **Start.** The supervised checkpoint (`train.sft`, cached; by default
   `RL_START`, which skips the tool in about half its episodes) is copied with its
   embeddings untied (vLLM's CPU build reloads tied ones wrongly; see
   `VLLMEngine.update_weights`) — the same function, as version 0 of the policy.
2. **Serve.** `treadle serve --vllm <policy v0>` in a child process: the rollout
   service, which starts a real vLLM engine (CPU build) with its RL endpoints, runs
   the math suite's tools in sandboxes and scores the answers. The trainer talks to
   it only over HTTP (`treadle.client.RolloutClient`), as any trainer would.
3. **Step.** Submit a job: `prompts_per_step` training tasks (never a held-out
   question) × `group_size` samples at temperature 1.0, stamped to start only once
   the engine serves the current version. Take each GRPO group as it completes
   (`client.groups`): group-normalised advantages, infrastructure failures dropped
   (never a reward of 0). Recompute every sampled token's log-probability with the
   trainer's copy of the weights, record how far it is from the engine's (max and
   mean |Δ|: in fp32 on the same weights they agree to about 1e-5), and update on
   the clipped ratio objective: `epochs` passes of `minibatches` optimizer steps
   (PPO's update; one of one is the plain GRPO gradient), each trajectory weighing
   the same (`loss_agg`). Save the weights (safetensors, with the tokenizer: each
   `weights/vN` is a checkpoint `treadle train eval` loads) and push them to the
   engine through the service's weight-update barrier (`POST /v1/weights/update`):
   the policy version advances, and the next job's tokens carry it.
   **Asynchronous** (`max_staleness` S > 0): the jobs of the next S steps are
   submitted before a step trains (`StepJobs`), so the engines keep sampling while
   the trainer computes and saves; the update is pushed with the `keep` mode (the
   running trajectories pause only while the engine loads, then run on under the
   new weights, their tokens stamped with it), and a step trains on tokens of
   versions step − S .. step, each weighed by its ratio to the logprob the engine
   recorded when it sampled it. The row records the staleness and the drift
   (`StepRow.stale_gap_mean`) beside the parity gap.
4. **Measure.** Every `eval_every` steps, and at the start and the end, the
   held-out success rate (mean reward on `eval_tasks` held-out tasks, one sample
   each at temperature 1.0) through the same service. Sampling is seeded per task,
   sample and turn (`seed`), so evaluations differ by their policies, not their draws.

Stops after `max_steps` or `max_minutes` of RL (wall clock, evaluations included).
The report (`rl.json`) holds the configuration, one row per step (reward, success,
rollout throughput, logprob gap, timings, policy version) and the evaluations; the
plot (`rl.png`) is drawn from it (`train.plot`).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.client.http import RolloutClient
from treadle.client.samples import TrainingSequence
from treadle.client.wire import SubmittedJob, suite_tasks
from treadle.train.evaluate import EVAL_LIMITS
from treadle.train.grpo_config import GRPOConfig
from treadle.train.serving import copy_tokenizer, prune, serving, untied_copy
from treadle.train.sft import sft
from treadle.train.transcripts import KINDS, heldout_tasks, math_suite, train_tasks
from treadle.train.update import policy_gradient_step
from treadle.types import Trajectory

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2ForCausalLM

Log = Callable[[str], None]
_LIMITS = EVAL_LIMITS.as_params()
_OPTIONS = {"kinds": list(KINDS)}


@dataclass(slots=True)
class StepRow:
    """What one step measured."""

    step: int  # 0-based
    policy_version: int  # of the rollouts this step trained on
    trajectories: int  # delivered
    trained: int  # trajectories with a non-zero advantage in their group
    excluded: int  # infrastructure failures (dropped, never scored)
    reward: float  # mean reward of the step's rollouts
    success: float  # share with reward 1
    tool_use: float  # share that called the python tool
    # The step's start to its last group (asynchronous: part of the rollout ran
    # during the steps before, so this is the trainer's wait, not the rollout's time).
    rollout_s: float
    train_s: float  # forward, backward, optimizer
    update_s: float  # save the weights and push them through the barrier
    tokens: int  # sampled tokens
    tokens_per_s: float  # sampled tokens / rollout_s
    # max and mean |engine - trainer| logprob over the tokens sampled under the
    # trainer's version (parity; train.update.LogprobGap)
    logprob_gap_max: float
    logprob_gap_mean: float
    loss: float
    minutes: float  # RL wall clock at the end of the step
    staleness_max: int = 0  # versions the oldest trained token lags the trainer
    stale_tokens: int = 0  # sampled tokens of an older version than the trainer's
    stale_gap_mean: float = 0.0  # mean |engine - trainer| logprob over those: the drift


@dataclass(slots=True)
class EvalRow:
    step: int  # steps trained before it (0: the supervised checkpoint)
    policy_version: int  # the version it asked for
    success: float  # held-out success rate
    tool_use: float  # share that called the python tool
    tasks: int
    minutes: float  # RL wall clock when it started (its policy's training time)
    versions: list[int] = field(default_factory=list)  # versions its tokens carry


@dataclass(slots=True)
class GRPOReport:
    config: dict[str, Any]
    steps: list[StepRow] = field(default_factory=list)
    evals: list[EvalRow] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        first, last = (self.evals[0], self.evals[-1]) if self.evals else (None, None)
        gaps = [s.logprob_gap_max for s in self.steps]
        return {
            "start_success": first.success if first else None,
            "final_success": last.success if last else None,
            "gain_points": 100 * (last.success - first.success) if first and last else None,
            "best_success": max((e.success for e in self.evals), default=None),
            "steps": len(self.steps),
            "rl_minutes": self.steps[-1].minutes if self.steps else 0.0,
            "max_logprob_gap": max(gaps, default=None),
            "max_staleness": max((s.staleness_max for s in self.steps), default=0),
            "stale_token_share": (sum(s.stale_tokens for s in self.steps)
                                  / max(1, sum(s.tokens for s in self.steps))),
            "final_policy_version": last.policy_version if last else 0,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "summary": self.summary(), "machine": self.machine,
                "steps": [asdict(s) for s in self.steps],
                "evals": [asdict(e) for e in self.evals]}


def async_vs_sync(sync: dict[str, Any], asynchronous: dict[str, Any]) -> dict[str, Any]:
    """Two runs' reports (`GRPOReport.to_dict()`: the same settings, synchronous and
    asynchronous) side by side, with what the comparison is about: steps a minute,
    held-out success at the end and at the best, staleness and drift."""
    def rate(report: dict[str, Any]) -> float:
        minutes = report["summary"]["rl_minutes"]
        return report["summary"]["steps"] / minutes if minutes else 0.0

    def drift(report: dict[str, Any]) -> float:
        rows = [r for r in report["steps"] if r["stale_tokens"]]
        return _mean([r["stale_gap_mean"] for r in rows])

    summary = {name: {**r["summary"], "steps_per_minute": rate(r),
                      "mean_stale_gap": drift(r)}
               for name, r in (("sync", sync), ("async", asynchronous))}
    return {"summary": {**summary,
                        "step_rate_ratio": (summary["async"]["steps_per_minute"]
                                            / summary["sync"]["steps_per_minute"]
                                            if summary["sync"]["steps_per_minute"] else None),
                        "final_success_points": 100 * ((summary["async"]["final_success"] or 0)
                                                       - (summary["sync"]["final_success"] or 0))},
            "sync": sync, "async": asynchronous}


def train_grpo(config: GRPOConfig, out: Path, *, cache_root: Path,
               log: Log = print) -> GRPOReport:
    """Run GRPO (see the module docstring); writes `out/rl.json` after every step."""
    import torch

    from treadle.train.model import load_model

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    checkpoint = sft(config.sft, cache_root, log=log)
    policy = untied_copy(checkpoint, out / "weights" / "v0")
    model = load_model(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99),
                                  weight_decay=0.0)
    report = GRPOReport(config=asdict(config),
                        machine={"python": platform.python_version(),
                                 "processor": platform.machine(), "cpus": os.cpu_count(),
                                 "torch": torch.__version__})
    with serving(policy, out, config, log=log) as client:
        jobs = StepJobs(client, config)
        started = time.monotonic()

        def minutes() -> float:
            return (time.monotonic() - started) / 60.0

        report.evals.append(evaluate_heldout(client, config, step=0, minutes=minutes()))
        log(f"held-out success at the start: {report.evals[-1].success:.1%}")
        for step in range(config.max_steps):
            if minutes() >= config.max_minutes:
                break
            row = run_step(client, jobs, model, optimizer, config, step, out, minutes)
            report.steps.append(row)
            log(f"step {step}: reward {row.reward:.3f}, {row.tokens_per_s:,.0f} tok/s, "
                f"logprob gap max {row.logprob_gap_max:.1e}, staleness {row.staleness_max} "
                f"({row.stale_tokens:,} tokens, drift {row.stale_gap_mean:.1e}), "
                f"loss {row.loss:+.4f} ({row.minutes:.1f} min)")
            if (step + 1) % config.eval_every == 0:
                report.evals.append(evaluate_heldout(client, config, step=step + 1,
                                                     minutes=minutes()))
                log(f"held-out success after {step + 1} steps: {report.evals[-1].success:.1%}")
            _write(report, out)
        if not report.evals or report.evals[-1].step != len(report.steps):
            report.evals.append(evaluate_heldout(client, config, step=len(report.steps),
                                                 minutes=minutes()))
        jobs.cancel_ahead()
    _write(report, out)
    return report


class StepJobs:
    """The rollout jobs of the steps to come, submitted ahead as far as the staleness
    bound lets them run: step s's job goes in when step s − S starts (S =
    `max_staleness`) and may start on version max(0, s − S), the version the engines
    serve then. Synchronous (S = 0): a step's job goes in at its start, on its own
    version. Older jobs first: the service runs a job's trajectories before a younger
    job's of the same priority, so the next step's rollouts fill what the current
    one's long tail leaves idle."""

    def __init__(self, client: RolloutClient, config: GRPOConfig) -> None:
        self._client = client
        self._config = config
        self._jobs: dict[int, SubmittedJob] = {}

    def take(self, step: int) -> SubmittedJob:
        """Step `step`'s job, submitting it and the next S steps' first if need be."""
        last = min(step + self._config.max_staleness, self._config.max_steps - 1)
        for s in range(step, last + 1):
            if s not in self._jobs:
                self._jobs[s] = self._submit(s)
        return self._jobs.pop(step)

    def cancel_ahead(self) -> None:
        """Cancel the jobs submitted for steps the run will not train (it stopped)."""
        for job in self._jobs.values():
            self._client.cancel(job.job_id)
        self._jobs.clear()

    def _submit(self, step: int) -> SubmittedJob:
        config = self._config
        suite = math_suite()
        tasks = [suite.task_to_record(t) for t in train_tasks(config.prompts_per_step,
                                                                seed=1000 + step)]
        return self._client.submit(
            tasks=suite_tasks("math", tasks=tasks, options=_OPTIONS),
            samples_per_task=config.group_size, sampling=_sampling(config), limits=_LIMITS,
            min_policy_version=max(0, step - config.max_staleness),
            job_id=f"train-{step:04d}-{secrets.token_hex(3)}")


def run_step(client: RolloutClient, jobs: StepJobs, model: Qwen2ForCausalLM,
             optimizer: torch.optim.Optimizer, config: GRPOConfig, step: int, out: Path,
             minutes: Callable[[], float]) -> StepRow:
    """One rollout job's groups, one policy-gradient step, one weight update (`keep`
    in asynchronous runs: the next steps' trajectories run on across it)."""
    t0 = time.monotonic()
    job = jobs.take(step)
    sequences: list[TrainingSequence] = []
    trajectories: list[Trajectory] = []
    excluded = 0
    for group in client.groups(job):
        trajectories += group.trajectories
        batch = group.batch()
        excluded += len(batch.exclusions)
        sequences += [s for s in batch.sequences if s.excluded is None]
    rollout_s = time.monotonic() - t0
    versions = {v for s in sequences for v, m in zip(s.policy_versions, s.loss_mask, strict=True)
                if m}
    if versions - set(range(step - config.max_staleness, step + 1)):
        raise RuntimeError(f"step {step} (max staleness {config.max_staleness}) got tokens "
                           f"of versions {sorted(versions)}")
    t1 = time.monotonic()
    loss, gap = policy_gradient_step(model, optimizer, sequences, config, version=step)
    train_s = time.monotonic() - t1
    t2 = time.monotonic()
    weights = out / "weights" / f"v{step + 1}"
    model.save_pretrained(weights)
    # A whole checkpoint (`treadle train eval --model`, vLLM and HFTokenizer load it).
    copy_tokenizer(out / "weights" / "v0", weights)
    client.update_weights(str(weights.resolve()), step + 1,
                          mode="keep" if config.max_staleness else "drain")
    prune(out / "weights", keep={"v0", f"v{step}", f"v{step + 1}"})
    update_s = time.monotonic() - t2
    scored = [t for t in trajectories if t.reward is not None]
    tokens = sum(sum(s.loss_mask) for s in sequences)
    return StepRow(
        step=step, policy_version=step, trajectories=len(trajectories),
        trained=sum(1 for s in sequences if s.advantage), excluded=excluded,
        reward=_mean([t.reward or 0.0 for t in scored]), **_shares(scored),
        rollout_s=rollout_s, train_s=train_s, update_s=update_s, tokens=tokens,
        tokens_per_s=tokens / rollout_s if rollout_s > 0 else 0.0,
        logprob_gap_max=gap.max, logprob_gap_mean=gap.mean, loss=loss, minutes=minutes(),
        staleness_max=step - min(versions, default=step), stale_tokens=gap.older_tokens,
        stale_gap_mean=gap.older_mean)


def evaluate_heldout(client: RolloutClient, config: GRPOConfig, *, step: int,
                     minutes: float) -> EvalRow:
    """Held-out success rate through the service (one sample per task), on the policy
    after `step` steps (version `step`)."""
    version = step
    suite = math_suite()
    tasks = [suite.task_to_record(t) for t in heldout_tasks(config.eval_tasks)]
    job = client.submit(tasks=suite_tasks("math", tasks=tasks, options=_OPTIONS),
                        samples_per_task=1, sampling=_sampling(config), limits=_LIMITS,
                        min_policy_version=version, priority=1,
                        job_id=f"eval-{step:04d}-{secrets.token_hex(3)}")
    done = [d.trajectory for d in client.trajectories(job.job_id)]
    scored = [t for t in done if not t.infra_failure]
    versions = sorted({v for t in done for seg in t.segments
                       for v, m in zip(seg.policy_versions, seg.loss_mask, strict=True) if m})
    return EvalRow(step=step, policy_version=version, **_shares(scored), tasks=len(scored),
                   minutes=minutes, versions=versions)


def _shares(scored: Sequence[Trajectory]) -> dict[str, float]:
    """`success` (reward 1) and `tool_use` (called python) shares of scored trajectories."""
    return {"success": _mean([1.0 if t.reward == 1.0 else 0.0 for t in scored]),
            "tool_use": _mean([1.0 if called_python(t) else 0.0 for t in scored])}


def _sampling(config: GRPOConfig) -> dict[str, float]:
    # Seeded per task, sample and turn (agent.loop.Sampling.seed): every evaluation
    # draws the same random numbers, so two differ by their policies, not their luck.
    return {"temperature": config.temperature, "seed": config.seed}


def called_python(trajectory: Trajectory) -> bool:
    """Whether a turn of `trajectory` called the python tool first (a turn records the
    first call of its reply, as the model named it)."""
    return any(t.tool_call is not None and t.tool_call.name == "python"
               for t in trajectory.turns)


def _write(report: GRPOReport, out: Path) -> None:
    (out / "rl.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0

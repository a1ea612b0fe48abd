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
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.client.errors import ServiceUnavailable
from treadle.client.http import RolloutClient
from treadle.client.samples import TrainingSequence
from treadle.client.stream import RetryPolicy
from treadle.client.wire import suite_tasks
from treadle.runtime.launcher import die_with_parent, free_port, stop_process_group
from treadle.sandbox.registry import usable_backend_name
from treadle.train.evaluate import EVAL_LIMITS
from treadle.train.logprobs import token_logprobs
from treadle.train.sft import SFTConfig, sft
from treadle.train.transcripts import HELDOUT_POOL, KINDS, heldout_tasks, math_suite, train_tasks
from treadle.types import Trajectory

if TYPE_CHECKING:
    import torch
    from transformers import Qwen2ForCausalLM

Log = Callable[[str], None]
_LIMITS = EVAL_LIMITS.as_params()
_OPTIONS = {"kinds": list(KINDS)}
LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean")  # verl's names
RL_START = SFTConfig(steps=800, direct_share=0.5)  # GRPOConfig's default starting point


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    """One RL run's settings (all of them go into the report)."""

    # The supervised starting point: half its transcripts answer without the tool, so
    # it calls python in about half its episodes (docs/training.md, "RL on top").
    sft: SFTConfig = RL_START
    prompts_per_step: int = 16  # training tasks per step
    group_size: int = 8  # samples per task (GRPO group)
    lr: float = 1e-4  # AdamW learning rate (constant; 3e-4 degraded, see docs/training.md)
    clip: float = 0.2  # PPO ratio clip
    # How token terms are averaged: "seq-mean-token-mean" (GRPO's: each trajectory
    # weighs the same, so in a group whose advantages sum to 0 the tokens all members
    # share cancel out) or "token-mean" (every sampled token weighs the same: long
    # failures outweigh short successes, and on this model that drags the shared
    # format tokens down; see docs/training.md).
    loss_agg: str = "seq-mean-token-mean"
    # Weight of negative advantages (1.0: GRPO as written). A failed trajectory's
    # tokens after its mistake are often right given it (the answer copies a wrong
    # program's output faithfully); pushing them down unlearns the copy.
    negative_scale: float = 1.0
    epochs: int = 2  # passes over each step's rollouts (PPO epochs)
    minibatches: int = 1  # optimizer steps per pass (the step's rollouts split evenly)
    max_grad_norm: float = 1.0  # gradient norm clip
    micro_batch: int = 32  # sequences per forward/backward (memory bound)
    temperature: float = 1.0  # rollout and evaluation sampling
    max_steps: int = 1000  # step limit
    max_minutes: float = 15.0  # RL wall-clock limit, evaluations included
    eval_every: int = 5  # steps between held-out evaluations
    eval_tasks: int = 256  # held-out tasks per evaluation (one sample each; ±3 points)
    # Torch seed of the trainer and base seed of every turn's sampling (the tasks of
    # step s use seed 1000 + s).
    seed: int = 0
    sandbox: str = "bwrap"  # where the tools run (bwrap; local where it is missing)
    vllm_python: str = ".venv-vllm/bin/python"  # the interpreter vLLM is installed in

    def __post_init__(self) -> None:
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg {self.loss_agg!r}: one of {', '.join(LOSS_AGGREGATIONS)}")
        if not 0.0 <= self.negative_scale <= 1.0:
            raise ValueError("negative_scale must be in [0, 1]")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError("epochs and minibatches must be >= 1")
        if self.prompts_per_step < 1 or self.group_size < 2 or self.max_steps < 1:
            raise ValueError("prompts_per_step and max_steps must be >= 1, group_size >= 2 "
                             "(a group of one has no advantage)")
        if self.lr <= 0 or self.max_minutes <= 0:
            raise ValueError("lr and max_minutes must be > 0")
        if self.eval_every < 1 or not 1 <= self.eval_tasks <= HELDOUT_POOL:
            raise ValueError(f"eval_every must be >= 1, eval_tasks in 1-{HELDOUT_POOL}")


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
    rollout_s: float  # submit to the last group
    train_s: float  # forward, backward, optimizer
    update_s: float  # save the weights and push them through the barrier
    tokens: int  # sampled tokens
    tokens_per_s: float  # sampled tokens / rollout_s
    logprob_gap_max: float  # max |engine - trainer| logprob of a sampled token
    logprob_gap_mean: float
    loss: float
    minutes: float  # RL wall clock at the end of the step


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
            "final_policy_version": last.policy_version if last else 0,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "summary": self.summary(), "machine": self.machine,
                "steps": [asdict(s) for s in self.steps],
                "evals": [asdict(e) for e in self.evals]}


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
        started = time.monotonic()

        def minutes() -> float:
            return (time.monotonic() - started) / 60.0

        report.evals.append(evaluate_heldout(client, config, step=0, minutes=minutes()))
        log(f"held-out success at the start: {report.evals[-1].success:.1%}")
        for step in range(config.max_steps):
            if minutes() >= config.max_minutes:
                break
            row = run_step(client, model, optimizer, config, step, out, minutes)
            report.steps.append(row)
            log(f"step {step}: reward {row.reward:.3f}, {row.tokens_per_s:,.0f} tok/s, "
                f"logprob gap max {row.logprob_gap_max:.1e}, loss {row.loss:+.4f} "
                f"({row.minutes:.1f} min)")
            if (step + 1) % config.eval_every == 0:
                report.evals.append(evaluate_heldout(client, config, step=step + 1,
                                                     minutes=minutes()))
                log(f"held-out success after {step + 1} steps: {report.evals[-1].success:.1%}")
            _write(report, out)
        if not report.evals or report.evals[-1].step != len(report.steps):
            report.evals.append(evaluate_heldout(client, config, step=len(report.steps),
                                                 minutes=minutes()))
    _write(report, out)
    return report


def run_step(client: RolloutClient, model: Qwen2ForCausalLM, optimizer: torch.optim.Optimizer,
             config: GRPOConfig, step: int, out: Path,
             minutes: Callable[[], float]) -> StepRow:
    """One rollout job, one policy-gradient step, one weight update."""
    suite = math_suite()
    tasks = [suite.task_to_record(t) for t in train_tasks(config.prompts_per_step,
                                                            seed=1000 + step)]
    t0 = time.monotonic()
    job = client.submit(tasks=suite_tasks("math", tasks=tasks, options=_OPTIONS),
                        samples_per_task=config.group_size,
                        sampling=_sampling(config), limits=_LIMITS,
                        min_policy_version=step, job_id=f"train-{step:04d}-{secrets.token_hex(3)}")
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
    if versions - {step}:
        raise RuntimeError(f"step {step} trained on tokens of versions {sorted(versions)}")
    t1 = time.monotonic()
    loss, gap_max, gap_mean = policy_gradient_step(model, optimizer, sequences, config)
    train_s = time.monotonic() - t1
    t2 = time.monotonic()
    weights = out / "weights" / f"v{step + 1}"
    model.save_pretrained(weights)
    # A whole checkpoint (`treadle train eval --model`, vLLM and HFTokenizer load it).
    copy_tokenizer(out / "weights" / "v0", weights)
    client.update_weights(str(weights.resolve()), step + 1)
    _prune(out / "weights", keep={"v0", f"v{step}", f"v{step + 1}"})
    update_s = time.monotonic() - t2
    scored = [t for t in trajectories if t.reward is not None]
    tokens = sum(sum(s.loss_mask) for s in sequences)
    return StepRow(
        step=step, policy_version=step, trajectories=len(trajectories),
        trained=sum(1 for s in sequences if s.advantage), excluded=excluded,
        reward=_mean([t.reward or 0.0 for t in scored]), **_shares(scored),
        rollout_s=rollout_s, train_s=train_s, update_s=update_s, tokens=tokens,
        tokens_per_s=tokens / rollout_s if rollout_s > 0 else 0.0,
        logprob_gap_max=gap_max, logprob_gap_mean=gap_mean, loss=loss, minutes=minutes())


def policy_gradient_step(model: Qwen2ForCausalLM, optimizer: torch.optim.Optimizer,
                         sequences: Sequence[TrainingSequence],
                         config: GRPOConfig) -> tuple[float, float, float]:
    """`config.epochs` passes over the step's sequences with a non-zero advantage, each
    in `config.minibatches` optimizer steps on the clipped-ratio objective averaged
    over the minibatch's sampled tokens (PPO's update; with one epoch of one minibatch
    it is the plain GRPO gradient). Returns (mean loss, max |Δ logprob|, mean |Δ
    logprob|): the gap between the engine's logprobs and the trainer's, measured
    before the first update (on the weights the engine sampled with) over every
    sampled token."""
    import torch

    rows = [s for s in sequences if sum(s.loss_mask)]
    gap_max, gap_mean = logprob_gap(model, rows, config.micro_batch)
    # A group whose members all scored alike has advantage 0 everywhere: no gradient.
    trained = [s for s in rows if s.advantage]
    if not trained:
        return 0.0, gap_max, gap_mean
    model.train()
    losses: list[float] = []
    for _epoch in range(config.epochs):
        order = torch.randperm(len(trained)).tolist()  # seeded in train_grpo
        parts = max(1, min(config.minibatches, len(trained)))
        for part in range(parts):
            # Micro-batches of similar lengths: padding to a long failure's length
            # would otherwise cost most of the step. The sum is order-independent.
            batch = sorted((trained[i] for i in order[part::parts]), key=_length)
            tokens = sum(sum(s.loss_mask) for s in batch)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for start in range(0, len(batch), config.micro_batch):
                ids, attention, mask, old, adv = _tensors(batch[start:start + config.micro_batch])
                adv = torch.where(adv < 0, adv * config.negative_scale, adv)
                new = token_logprobs(model, ids, attention)  # (B, T-1)
                ratio = torch.exp(new - old)
                clipped = torch.clamp(ratio, 1.0 - config.clip, 1.0 + config.clip)
                objective = torch.minimum(ratio * adv[:, None], clipped * adv[:, None]) * mask
                if config.loss_agg == "token-mean":
                    loss = -objective.sum() / tokens
                else:  # seq-mean-token-mean
                    loss = -(objective.sum(1) / mask.sum(1)).sum() / len(batch)
                loss.backward()  # type: ignore[no-untyped-call]
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            losses.append(total)
    model.eval()  # type: ignore[no-untyped-call]
    return _mean(losses), gap_max, gap_mean


def logprob_gap(model: Qwen2ForCausalLM, rows: Sequence[TrainingSequence],
                micro_batch: int) -> tuple[float, float]:
    """(max, mean) |engine logprob - trainer logprob| over every sampled token."""
    import torch

    gap_max, gap_sum, count = 0.0, 0.0, 0.0
    rows = sorted(rows, key=_length)  # micro-batches of similar lengths
    model.eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for start in range(0, len(rows), micro_batch):
            ids, attention, mask, old, _adv = _tensors(rows[start:start + micro_batch])
            gap = (token_logprobs(model, ids, attention) - old).abs() * mask
            gap_max = max(gap_max, float(gap.max()))
            gap_sum += float(gap.sum())
            count += float(mask.sum())
    return gap_max, gap_sum / count if count else 0.0


def _length(row: TrainingSequence) -> int:
    return len(row.prompt_ids) + len(row.response_ids)


def _tensors(rows: Sequence[TrainingSequence]) -> tuple[torch.Tensor, ...]:
    """Right-padded ids and attention (B, T); mask, engine logprobs (B, T-1) aligned
    with `token_logprobs`'s targets; advantages (B,)."""
    import torch

    length = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1)
    old = torch.zeros(len(rows), length - 1)
    for i, r in enumerate(rows):
        seq = r.prompt_ids + r.response_ids
        ids[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        first = len(r.prompt_ids) - 1  # target position of the first response token
        mask[i, first:first + len(r.response_ids)] = torch.tensor(r.loss_mask,
                                                                  dtype=torch.float32)
        old[i, first:first + len(r.response_ids)] = torch.tensor(r.logprobs)
    adv = torch.tensor([r.advantage or 0.0 for r in rows])
    return ids, attention, mask, old, adv


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


def untied_copy(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` with its output projection a copy of the embeddings (the same
    function), saved to `out` with the tokenizer files."""
    import torch

    from treadle.train.model import load_model

    model = load_model(checkpoint)
    if model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(
            model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(out)
    copy_tokenizer(checkpoint, out)
    return out


def copy_tokenizer(checkpoint: Path, out: Path) -> None:
    """The tokenizer files (and generation config) of `checkpoint`, copied to `out`."""
    for f in checkpoint.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                        "generation_config.json",
                                                        "chat_template.jinja"):
            shutil.copy2(f, out / f.name)


@contextmanager
def serving(policy: Path, out: Path, config: GRPOConfig, *,
            log: Log) -> Iterator[RolloutClient]:
    """`treadle serve --vllm policy` as a child process, and a client of it."""
    token = secrets.token_hex(16)
    port = free_port()
    sandbox = usable_backend_name() if config.sandbox == "bwrap" else config.sandbox
    cmd = [sys.executable, "-m", "treadle", "serve", "--port", str(port), "--token", token,
           "--db", str(out / "rollouts.db"), "--vllm", str(policy), "--vllm-python",
           config.vllm_python, "--sandbox", sandbox, "--policy", "verl",
           "--log-level", "warning"]
    with open(out / "serve.log", "ab") as service_log:
        proc = subprocess.Popen(cmd, stdout=service_log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    client = RolloutClient(url, token=token, timeout_s=60.0)
    # One try per probe: the start-up wait is this loop's, not the client's retries.
    probe = RolloutClient(url, token=token, timeout_s=5.0, retry=RetryPolicy(attempts=1,
                                                                             patience_s=0.0))
    try:
        log(f"starting the rollout service with a vLLM engine ({url}; log {out / 'serve.log'})")
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"treadle serve exited with {proc.returncode}; see "
                                   f"{out / 'serve.log'}")
            try:
                if probe.health().engines >= 1:
                    break
            except ServiceUnavailable:  # not up yet (anything else is a real error)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the service did not come up in 300 s; see "
                                   f"{out / 'serve.log'}")
            time.sleep(1.0)
        yield client
    finally:
        probe.close()
        client.close()
        stop_process_group(proc, timeout_s=60)


def _prune(folder: Path, keep: set[str]) -> None:
    for d in folder.iterdir():
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)


def _write(report: GRPOReport, out: Path) -> None:
    (out / "rl.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0

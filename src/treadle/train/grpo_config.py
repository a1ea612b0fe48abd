"""A GRPO run's settings (`GRPOConfig`), apart from the loop so that the update
(`train.update`) and the serving (`train.serving`) read them without importing the loop."""

from __future__ import annotations

from dataclasses import dataclass

from treadle.train.sft import SFTConfig
from treadle.train.transcripts import HELDOUT_POOL

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
    # Asynchronous RL: how many policy versions a trained token may lag behind the
    # trainer. 0 is synchronous (each step rolls out on its own version, then trains);
    # S > 0 keeps the next S steps' rollouts running while a step trains and pushes
    # its weights with the `keep` mode, so a trajectory runs on across the update and
    # a step trains on tokens of versions step - S .. step (docs/training.md).
    max_staleness: int = 0

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
        if not 0 <= self.max_staleness <= 4:
            raise ValueError("max_staleness must be in 0-4 (versions a token may lag)")
        if self.eval_every < 1 or not 1 <= self.eval_tasks <= HELDOUT_POOL:
            raise ValueError(f"eval_every must be >= 1, eval_tasks in 1-{HELDOUT_POOL}")

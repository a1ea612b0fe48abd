"""Held-out success rate of a checkpoint, through the real agent loop.

    report = evaluate_checkpoint(path, tasks=200, temperature=1.0, seed=0)

Every held-out task (`transcripts.heldout_tasks`) runs as a real episode: the agent
loop (`treadle.agent.loop.run_agent`) samples a reply from the engine, parses its
tool calls, runs them in a sandbox through the suite's episode (the `python` tool
really runs the model's program), appends the observation and samples again, until
the model submits an answer, stops calling tools or hits `EVAL_LIMITS`; the suite's
reward scores it. The default engine is `TorchEngine` on the checkpoint (any
`Engine` can be passed to `evaluate`, e.g. `VLLMEngine` on a vLLM server).

Reported: `success` (mean reward), `well_formed` (the episode went as in the
transcripts: a python call whose program ran without error, then `submit_answer`),
`submitted` (an answer was submitted at all), per-kind success, trajectory statuses
and timing. With a seeded `TorchEngine`, request ids ``<task>-<sample>-<n>`` make a
run reproducible (see its docstring for the float-rounding caveat).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from treadle.agent.loop import AgentLimits, run_agent
from treadle.agent.runner import EngineTurns, Sampling
from treadle.agent.tokenizer import HFTokenizer, Tokenizer
from treadle.engines.base import Engine
from treadle.envs.base import open_episode
from treadle.sandbox.base import SandboxBackend
from treadle.train.transcripts import heldout_tasks, math_suite
from treadle.types import GroupKey, Task, Trajectory

# Two turns solve a task; four leave room for a retry. 96 tokens is ~3x the longest
# transcript reply; 1024 is the model's context.
EVAL_LIMITS = AgentLimits(max_turns=4, max_total_tokens=1024, max_tokens_per_turn=96)


@dataclass(frozen=True, slots=True)
class EvalReport:
    """What one evaluation measured."""

    trajectories: int  # tasks x samples
    temperature: float  # sampling temperature of every turn
    seed: int  # the engine's sampling seed
    success: float  # mean reward (the suite's reward is 1 for a right answer, else 0)
    well_formed: float  # share that ran a python program without error, then submitted
    submitted: float  # share that called submit_answer
    per_kind: dict[str, float]  # success by math kind
    statuses: dict[str, int]  # trajectory terminal statuses
    mean_turns: float  # LLM replies per trajectory
    seconds: float  # wall time of the whole evaluation

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Rollout:
    """One evaluated trajectory with what its episode recorded."""

    task: Task  # the task it ran
    trajectory: Trajectory  # token-exact record, status, reward
    calls: list[tuple[str, bool]]  # (tool name, call succeeded) in call order

    @property
    def well_formed(self) -> bool:
        """Went as in the transcripts: a python program that ran, then an answer."""
        return (len(self.calls) == 2 and self.calls[0] == ("python", True)
                and self.calls[1][0] == "submit_answer")


async def rollouts(engine: Engine, tokenizer: Tokenizer, tasks: Sequence[Task],
                   backend: SandboxBackend, *, temperature: float = 1.0, samples: int = 1,
                   limits: AgentLimits = EVAL_LIMITS, concurrency: int = 64) -> list[Rollout]:
    """`samples` trajectories of every task on `engine`, scored, in (task, sample) order."""
    suite = math_suite()
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task, sample: int) -> Rollout:
        async with gate, open_episode(suite, task, backend) as episode:
            runner = EngineTurns(engine, request_prefix=f"{task.task_id}-{sample}")
            traj = await run_agent(episode, tokenizer, runner,
                                   traj_id=f"{task.task_id}-{sample}",
                                   key=GroupKey(task.task_id, sample), limits=limits,
                                   sampling=Sampling(temperature=temperature))
            return Rollout(task, traj, [(r.name, r.result.ok) for r in episode.history])

    return list(await asyncio.gather(*(one(t, s) for t in tasks for s in range(samples))))


def summarize(runs: Sequence[Rollout], *, temperature: float, seed: int,
              seconds: float) -> EvalReport:
    """The report of a set of rollouts."""
    n = max(1, len(runs))
    kinds: dict[str, list[float]] = {}
    for r in runs:
        kinds.setdefault(str(r.task.metadata.get("kind", "")), []).append(_reward(r))
    return EvalReport(
        trajectories=len(runs), temperature=temperature, seed=seed,
        success=sum(map(_reward, runs)) / n,
        well_formed=sum(r.well_formed for r in runs) / n,
        submitted=sum(any(name == "submit_answer" for name, _ in r.calls) for r in runs) / n,
        per_kind={k: sum(v) / len(v) for k, v in sorted(kinds.items())},
        statuses=dict(sorted(Counter(r.trajectory.status.value for r in runs).items())),
        mean_turns=sum(len(r.trajectory.turns) for r in runs) / n,
        seconds=seconds)


def _reward(run: Rollout) -> float:
    return run.trajectory.reward or 0.0  # None only for infrastructure errors


async def evaluate(engine: Engine, tokenizer: Tokenizer, tasks: Sequence[Task],
                   backend: SandboxBackend, *, temperature: float = 1.0, samples: int = 1,
                   seed: int = 0, limits: AgentLimits = EVAL_LIMITS,
                   concurrency: int = 64) -> EvalReport:
    """Run `samples` trajectories of every task on `engine` and score them (`seed` is
    recorded in the report: it is the engine's, set where the engine was made)."""
    start = time.perf_counter()
    runs = await rollouts(engine, tokenizer, tasks, backend, temperature=temperature,
                          samples=samples, limits=limits, concurrency=concurrency)
    return summarize(runs, temperature=temperature, seed=seed,
                     seconds=time.perf_counter() - start)


def evaluate_checkpoint(path: str | Path, *, tasks: int = 200, temperature: float = 1.0,
                        samples: int = 1, seed: int = 0, backend: str = "local",
                        max_batch: int = 64) -> EvalReport:
    """`evaluate` on the first `tasks` held-out tasks with a `TorchEngine` on `path`."""
    from treadle.sandbox.registry import get_backend
    from treadle.train.engine import TorchEngine

    async def main() -> EvalReport:
        async with TorchEngine.from_checkpoint(path, seed=seed, max_batch=max_batch) as engine:
            return await evaluate(engine, HFTokenizer(path), heldout_tasks(tasks),
                                  get_backend(backend), temperature=temperature,
                                  samples=samples, seed=seed)

    return asyncio.run(main())

"""Agentic judges: a rubric dimension judged by an agent with tools in a sandbox.

    reply = await run_agent_judge(runtime, tokenizer, pool, prompt, call_id=...,
                                  spec=AgentSpec(("bash", "read_file"), max_turns=6),
                                  files=work_tree, read=verdict_value, chat="hermes",
                                  max_tokens=512, temperature=0.0, seed=0)

The judge is treadle's own agent loop (`runtime.rollout.run_task`, `agent.loop`) on
a one-off suite (`JudgeSuite`): its task is the dimension's rendered template; its
sandbox, from `pool`, is set up with a copy of the judged trajectory's work tree
(`rewards.JudgeInput.files`); its tools are the spec's (`rubric.JUDGE_TOOLS`) and
``submit_answer``; its turns are of the scheduler's judge class (after every
rollout turn, paused first), on the lane's engines. The episode's "reward" is the
verdict: the suite scores the final answer (the submitted one, else the last
reply) with `read`, the dimension's parser, which raises `VerdictError` when the
answer holds no verdict on the scale.

`run_agent_judge` returns the episode as a `JudgeReply`: `text` the whole episode
after the prompt (replies and tool observations, decoded: the audit),
`verdict_text` the final answer, `output_ids`/`logprobs` the tokens the judge
sampled, in order — also when the answer holds no verdict (the caller's parser
refuses it then, and its failed judgement keeps the episode). It raises
`JudgeCallError` when the episode failed otherwise (no sandbox, the sandbox could
not start, the engines, a tool's infrastructure); the caller (`rewards.Judges`)
retries within its budget and then leaves the dimension without a value, with the
reasons.

Limits: the judge's replies are sampled freely (its tool calls cannot be decoded
under the verdict's schema), so a small model's answer may hold no verdict; what
the judge writes in its sandbox is dropped with the sandbox; the work tree it gets
is what `envs.worktree` read (bounded: files past the bounds are not there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from treadle.agent.loop import AgentLimits
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import Tokenizer
from treadle.envs.base import RewardResult, Suite
from treadle.envs.errors import TaskFormatError
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool, ToolContext
from treadle.envs.tools.exec import BashTool, PythonTool
from treadle.envs.tools.files import ReadFileTool, WriteFileTool
from treadle.envs.tools.patch import ApplyPatchTool
from treadle.rewards import AgentSpec, JudgeCallError, JudgeReply, VerdictError
from treadle.runtime.driver import Runtime
from treadle.runtime.rollout import run_task
from treadle.sandbox.base import Limits
from treadle.sandbox.pool import SandboxPool
from treadle.types import GroupKey, Task, Trajectory, TrajectoryStatus

TOOL_TIMEOUT_S = 30.0  # one bash or python call of a judge
_TOOLS: dict[str, Callable[[], Tool]] = {
    "bash": lambda: BashTool(timeout_s=TOOL_TIMEOUT_S),
    "python": lambda: PythonTool(timeout_s=TOOL_TIMEOUT_S),
    "read_file": ReadFileTool,
    "write_file": WriteFileTool,
    "apply_patch": ApplyPatchTool,
}
ANSWER_HINT = 'your verdict: a JSON object {"score": n, "reason": "..."}'


class JudgeSuite(Suite):
    """One agentic judgement's environment (module docstring): not a task suite, it
    has no tasks of its own and no records."""

    name = "judge"
    limits = Limits(cpu_s=20, memory_mb=512, wall_timeout_s=60)

    def __init__(self, files: Mapping[str, str] | None = None, tools: tuple[str, ...] = (),
                 read: Callable[[str], float] | None = None) -> None:
        """`read`: the dimension's parser; None only for a suite that names the
        sandbox pool and its limits (`SuitePools.pool`), never scored."""
        self.files = dict(files or {})
        self.tool_names = tools
        self.read = read
        self.answer: str | None = None  # the judge's final answer, once scored
        self.no_verdict: VerdictError | None = None  # why the answer holds no verdict

    def tasks(self, n: int | None = None, seed: int = 0) -> list[Task]:
        return []

    def task_from_record(self, record: Mapping[str, Any]) -> Task:
        raise TaskFormatError("a judge's episode has no task records")

    def tools(self, task: Task) -> list[Tool]:
        return [*(_TOOLS[name]() for name in self.tool_names), SubmitAnswerTool(ANSWER_HINT)]

    async def setup(self, ctx: ToolContext) -> str | None:
        sandbox = ctx.require_sandbox()
        for path, text in sorted(self.files.items()):
            await sandbox.put_file(path, text.encode())
        return None

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        """The verdict's value of the final answer; VerdictError when it holds none."""
        self.answer = ctx.final_answer if ctx.final_answer is not None else final_message
        try:
            if self.read is None:
                raise VerdictError("no verdict parser: this suite only names a pool")
            value = self.read(self.answer or "")
        except VerdictError as e:
            self.no_verdict = e
            raise
        return RewardResult(value, {}, "the judge's verdict")


async def run_agent_judge(runtime: Runtime, tokenizer: Tokenizer, pool: SandboxPool | None,
                          prompt: str, *, call_id: str, spec: AgentSpec,
                          files: Mapping[str, str], read: Callable[[str], float], chat: str,
                          max_tokens: int, temperature: float,
                          seed: int | None) -> JudgeReply:
    """One agentic judgement (module docstring)."""
    if pool is None:
        raise JudgeCallError("an agentic judge needs a sandbox, and the service has none")
    suite = JudgeSuite(files, spec.tools, read)
    task = Task(task_id=call_id, prompt=prompt, suite=suite.name, metadata={})
    limits = AgentLimits(max_turns=spec.max_turns, max_total_tokens=spec.max_total_tokens,
                         max_tokens_per_turn=spec.max_tokens_per_turn or max_tokens)
    traj = await run_task(runtime, suite, task, traj_id=call_id, key=GroupKey(call_id, 0),
                          tokenizer=tokenizer, sandboxes=pool, limits=limits,
                          sampling=Sampling(temperature, seed=seed), chat_format=chat,
                          judge=True)
    if traj.status is TrajectoryStatus.ERROR and suite.no_verdict is None:
        raise JudgeCallError(f"the judge's episode: {traj.reason}")
    # An answer without a verdict is returned as any answer: the caller's parser
    # refuses it, and the failed judgement keeps the episode (the audit).
    return episode_reply(traj, tokenizer, suite.answer or "")


def episode_reply(traj: Trajectory, tokenizer: Tokenizer, answer: str) -> JudgeReply:
    """A judge's episode as a reply (module docstring)."""
    said: list[int] = []
    logprobs: list[float] = []
    text: list[str] = []
    for segment in traj.segments:
        text.append(tokenizer.decode(segment.response_ids))
        for token, mask, logprob in zip(segment.response_ids, segment.loss_mask,
                                        segment.logprobs, strict=True):
            if mask:
                said.append(token)
                logprobs.append(logprob)
    return JudgeReply(text="".join(text), output_ids=said, logprobs=logprobs,
                      verdict_text=answer)


__all__ = ["JudgeSuite", "episode_reply", "run_agent_judge"]

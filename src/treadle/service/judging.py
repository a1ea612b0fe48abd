"""Judging a job's trajectories on its rubric, before they are delivered.

`Judging.judged(work, traj)` is what the job runner calls on each finished suite or
harness trajectory of a job with a rubric (`JobRequest.rubric`), and
`judged_session` what the gateway calls on a session its owner ended with a
reward, where the session belongs to a sessions job with a rubric (before it is
delivered; the owner's `POST /v1/sessions/{id}/end` answers once the judges are
in). Each builds the job's lane
(`runtime.judge_lanes`: the policy's or the frozen pool's engines, as the
scheduler's judge class, or an endpoint URL), shows the judge the task, the final
answer and the conversation (`judge_input`), and returns the trajectory with its
reward vector (`rewards.Judges`). A trajectory is delivered once its judgements are
in; it keeps its slot of the job runner while it waits for them (not an engine's:
judge turns are queued as any turn). The verdict cache is the service's, shared by
its jobs. A job without a rubric is returned untouched.

For SWE and code tasks the judges see the change the agent made (`$diff`): where
the rubric asks for it, the attempt reads the work tree before its sandbox closes
(`capture`, `envs.worktree`) and the diff against the task's initial files is cut
at the rubric's `judge.diff_chars` with a marker line.

An agentic judged dimension (`rubric.AgentSpec`) runs on the same lane's engines
as an agent in a sandbox of the service's pool for suite ``judge``, set up with a
copy of the work tree read so (`runtime.agent_judges`).

A session has no task: its `$task` is its first user message; its `$answer` its
last reply; the owner's reward and `rewards` are what the rubric's verified
dimensions measure (`metric` `reward`, or a name of `rewards`). A harness run's and
a session's `$diff` is empty and an agentic judge's sandbox starts empty: their work
trees are the harness's, out of treadle's reach.

Limits: the frozen pool judges only where the service has frozen engines, else each call
fails once the runtime's grace for an engine is over (`engine_wait_s`) and the
dimension is left without a verdict, with that reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from treadle.agent.chat import Message, chat_format, prompt_messages
from treadle.agent.tokenizer import Tokenizer
from treadle.envs.worktree import WorkTreeCapture
from treadle.rewards import JudgeInput, JudgeLane, Judges
from treadle.rewards.judging import JudgeCache, conversation_text
from treadle.runtime.agent_judges import JudgeSuite
from treadle.runtime.driver import Runtime
from treadle.runtime.judge_lanes import EndpointLane, EngineLane
from treadle.runtime.suite_pools import SuitePools
from treadle.service.planning import HarnessWork, SuiteWork
from treadle.service.rubric_schemas import JudgeParams, RubricParams
from treadle.types import Task, Trajectory


class Judging:
    """The service's judging (module docstring)."""

    def __init__(self, runtime: Runtime, frozen: Runtime, tokenizer: Tokenizer | None,
                 sandboxes: SuitePools | None = None) -> None:
        self.runtime = runtime
        self.frozen = frozen
        self.tokenizer = tokenizer
        self.sandboxes = sandboxes  # agentic judges' sandboxes (None: none run)
        self.cache = JudgeCache()

    def capture(self, work: SuiteWork) -> WorkTreeCapture | None:
        """What reads the attempt's work tree for its judges, where its rubric shows
        them the diff (None: nothing to read)."""
        if work.rubric is None or not work.rubric.rubric().needs_work_tree:
            return None
        return WorkTreeCapture()

    async def judged(self, work: SuiteWork | HarnessWork, traj: Trajectory,
                     capture: WorkTreeCapture | None = None) -> Trajectory:
        """`traj` judged on its job's rubric (module docstring); `capture`: its work
        tree, read before its sandbox closed (`capture`)."""
        if work.rubric is None or self.tokenizer is None:
            return traj
        seen = judge_input(task_text(work.task), traj, self.tokenizer, work.chat_format)
        if capture is not None:
            seen = dataclasses.replace(
                seen, diff=capture.diff(work.rubric.judge.diff_chars),
                files={} if capture.tree is None else capture.tree.files)
        return await self._judge(work.rubric, work.chat_format, traj, seen)

    async def judged_session(self, job: Mapping[str, Any], traj: Trajectory,
                             history: Sequence[Message], chat: str) -> Trajectory:
        """A session's trajectory judged on the rubric of its job (`job`: the stored
        job spec; none: untouched), from its conversation (`history`)."""
        raw = job.get("request", {}).get("rubric")
        if raw is None or self.tokenizer is None:
            return traj
        first = next((m.content for m in history if m.role == "user"), "")
        seen = judge_input(first, traj, self.tokenizer, chat)
        return await self._judge(RubricParams.model_validate(raw), chat, traj, seen)

    async def _judge(self, rubric: RubricParams, chat: str, traj: Trajectory,
                     seen: JudgeInput) -> Trajectory:
        judge = rubric.judge
        judges = Judges(self.lane(judge, chat), attempts=judge.attempts,
                        timeout_s=judge.timeout_s, clock=self.runtime.clock, cache=self.cache)
        return await judges.judge(rubric.rubric(), traj, seen)

    def lane(self, judge: JudgeParams, chat: str) -> JudgeLane:
        if judge.url is not None:
            return EndpointLane(judge.url, judge.model, max_tokens=judge.max_tokens,
                                temperature=judge.temperature, api_key=judge.api_key,
                                timeout_s=judge.timeout_s)
        runtime = self.frozen if judge.engines == "frozen" else self.runtime
        pool = None if self.sandboxes is None else self.sandboxes.pool(JudgeSuite())
        return EngineLane(runtime, self.tokenizer_or_fail(), pool=judge.engines, chat=chat,
                          max_tokens=judge.max_tokens, temperature=judge.temperature,
                          sandboxes=pool)

    def tokenizer_or_fail(self) -> Tokenizer:
        if self.tokenizer is None:  # judged() returns first: suite jobs need one
            raise RuntimeError("judging on the engines needs the served model's tokenizer")
        return self.tokenizer


def task_text(task: Task) -> str:
    """A task's prompt as a judge's $task: its text, or its messages as text."""
    messages = prompt_messages(task.prompt)
    return messages[-1].content if len(messages) == 1 else conversation_text(
        [(m.role, m.content) for m in messages])


def judge_input(task: str, traj: Trajectory, tokenizer: Tokenizer, chat: str) -> JudgeInput:
    """What a judge may see of a trajectory: the task (`task_text`), the final answer
    (the last reply the model sampled, as its chat format reads it) and the
    conversation (the last segment's tokens, decoded: the chat template's text of the
    whole context)."""
    if not traj.segments:
        return JudgeInput(task=task, answer="", trajectory="")
    last = traj.segments[-1]
    end = max((i for i, m in enumerate(last.loss_mask) if m), default=-1)
    start = end
    while start > 0 and last.loss_mask[start - 1]:
        start -= 1
    fmt = chat_format(chat)
    stop = tokenizer.token_id(fmt.stop_token)
    reply = [i for i in last.response_ids[start:end + 1] if i != stop] if end >= 0 else []
    answer = fmt.reply(tokenizer.decode(reply)).text if reply else ""
    return JudgeInput(task=task, answer=answer,
                      trajectory=tokenizer.decode(last.prompt_ids + last.response_ids))

"""The base of suites scored on a final answer (math, stem, search).

The answer is the last `submit_answer` argument if the model submitted one, else
its final assistant message (from which `extract_answer` takes the boxed or
"answer is" part). `score_answer(task, text)` is a pure function of the task and
the text, so the reward can be tested, and recomputed offline, without a sandbox.
"""

from __future__ import annotations

from abc import abstractmethod

from treadle.envs.base import RewardResult, Suite
from treadle.envs.tools.answer import SubmitAnswerTool
from treadle.envs.tools.base import Tool, ToolContext
from treadle.envs.tools.exec import PythonTool
from treadle.types import Task

DEFAULT_GENERATED = 100  # tasks(None) of a generated suite


class AnswerSuite(Suite):
    """A suite whose reward depends only on the final answer text."""

    answer_hint = "the final answer only"

    def __init__(self, *, python_tool: bool = True, python_timeout_s: float = 20.0,
                 python_session: bool = False) -> None:
        self.python_tool = python_tool
        self.python_timeout_s = python_timeout_s
        # The python tool as cells of one session per episode (needs bwrap's resident
        # executor); off: each call a fresh process.
        self.python_session = python_session

    def needs_sandbox(self, task: Task) -> bool:
        return self.python_tool  # the python tool runs code; nothing else needs a sandbox

    def tools(self, task: Task) -> list[Tool]:
        tools: list[Tool] = []
        if self.python_tool:
            tools.append(PythonTool(timeout_s=self.python_timeout_s,
                                    session=self.python_session))
        tools.append(SubmitAnswerTool(self.answer_hint))
        return tools

    @abstractmethod
    def score_answer(self, task: Task, answer: str | None) -> RewardResult:
        """The reward of `answer` (None: the model gave none) for `task`."""

    async def reward(self, ctx: ToolContext, final_message: str | None) -> RewardResult:
        answer = ctx.final_answer if ctx.final_answer is not None else final_message
        return self.score_answer(ctx.task, answer)


def count(n: int | None) -> int:
    """`n` checked, or the default number of generated tasks."""
    if n is None:
        return DEFAULT_GENERATED
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return n

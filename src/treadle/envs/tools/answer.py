"""`submit_answer`: the agent's final answer; ends the episode."""

from __future__ import annotations

from typing import Any

from treadle.envs.tools.base import Tool, ToolContext, ToolReplay, ToolResult


class SubmitAnswerTool(Tool):
    """Records the answer in the context and marks the episode done.

    The answer is scored later by the suite's reward function, not here, so the
    observation says nothing about whether it is right.
    """

    replay = ToolReplay.NONE  # resumed: an answer changes nothing a later call sees

    def __init__(self, hint: str = "the final answer only") -> None:
        self.hint = hint

    @property
    def name(self) -> str:
        return "submit_answer"

    @property
    def description(self) -> str:
        return (f"Submit your final answer ({self.hint}). This ends the task; "
                "call it exactly once, when you are done.")

    @property
    def parameters(self) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"answer": {"type": "string", "maxLength": 100_000}},
                "required": ["answer"], "additionalProperties": False}

    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return ToolResult(output="answer submitted", final_answer=arguments["answer"],
                          done=True)

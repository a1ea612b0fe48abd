"""The wire schema of a served tool's answer (`POST /v1/sessions/{id}/tools/{name}`)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from treadle.envs.tools.base import ToolResult


class ToolReply(BaseModel):
    """One tool call's result (`envs.tools.base.ToolResult`), as the harness gets it."""

    output: str = Field(description="what the tool produced (stdout, a file, hits)")
    error: str | None = Field(description="why the call failed, in words for the model "
                                          "(bad arguments, a non-zero exit); null if it "
                                          "did not")
    ok: bool = Field(description="true when error is null")
    observation: str = Field(description="the text treadle's agent loop shows the model: "
                                         "the output, then the error")
    latency_s: float = Field(description="the call's wall seconds")
    final_answer: str | None = Field(description="the answer a submit_answer call gave")
    done: bool = Field(description="the call ended the episode: later calls are refused "
                                   "as the tool's error")

    @classmethod
    def of(cls, result: ToolResult) -> ToolReply:
        return cls(output=result.output, error=result.error, ok=result.ok,
                   observation=result.observation(), latency_s=result.latency_s,
                   final_answer=result.final_answer, done=result.done)


__all__ = ["ToolReply"]

"""The tool interface: one spec for the chat template, one async call, one result.

    class Tool(ABC):
        name, description, parameters   -> spec (OpenAI/Hermes function format)
        async def call(arguments, ctx)  -> ToolResult

Contracts every tool keeps:

- **Errors are observations.** Bad arguments (checked against `parameters` before
  the tool body runs), a non-zero exit, a timeout, a missing file, an unknown path:
  `call` returns a `ToolResult` whose `error` explains it in words the model can act
  on. It never raises for what the model did.
- **Infrastructure failures raise.** A closed or dead sandbox (`SandboxError` other
  than path/file problems), a code-running tool given no sandbox (`EnvConfigError`),
  an unreachable external server (`ResourcesServerError`): the trajectory failed,
  not the agent, and must not be trained on.
- **Every call is timed.** `ToolResult.latency_s` is the wall time of the whole
  call, validation included; the scheduler's tool-latency predictor learns from it.
- **Code runs only in the sandbox.** Tools that execute anything do it through
  `ctx.sandbox.exec`; file tools use the sandbox's file API, which refuses paths
  outside the work dir and never follows symlinks.

A tool object is stateless and may be shared by many episodes; per-episode state
lives in `ToolContext.state`.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from treadle.envs.errors import EnvConfigError, EnvError
from treadle.envs.tools._schema import check, function_spec
from treadle.errors import SandboxFileError, SandboxPathError
from treadle.sandbox.base import Sandbox
from treadle.types import Task, ToolCall

DEFAULT_MAX_OUTPUT_CHARS = 8000  # per observation; longer output keeps its head and tail


@dataclass(slots=True)
class ToolResult:
    """What one tool call produced. Built by the tool; never raised."""

    output: str = ""  # the observation text (stdout, file content, search hits...)
    error: str | None = None  # set when the call failed; says why, for the model
    latency_s: float = 0.0  # wall seconds of the whole call (set by Tool.call)
    final_answer: str | None = None  # set by submit_answer: the agent's final answer
    done: bool = False  # the episode is over after this call (answer given, env ended)

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self) -> str:
        """The text to append to the model's context: the output, then the error."""
        if self.error is None:
            return self.output
        if self.output:
            return f"{self.output.rstrip()}\n[error] {self.error}"
        return f"[error] {self.error}"

    def to_tool_call(self, name: str, arguments: Mapping[str, Any],
                     output_tokens: int = 0) -> ToolCall:
        """The trajectory record (`treadle.types.ToolCall`) of this call."""
        return ToolCall(name=name, arguments=dict(arguments), latency_s=self.latency_s,
                        output_tokens=output_tokens, error=self.error)


@dataclass(slots=True)
class ToolRecord:
    """One call as the episode saw it: what was asked and what came back."""

    call_id: str  # "call_<n>", n counting from 0 within the episode
    name: str
    arguments: dict[str, Any]
    result: ToolResult


@dataclass(slots=True)
class ToolContext:
    """Everything a tool call may use: the task, the sandbox, per-episode state."""

    task: Task
    sandbox: Sandbox | None = None  # None for suites that run no code
    state: dict[str, Any] = field(default_factory=dict)  # per-episode scratch (adapters)
    history: list[ToolRecord] = field(default_factory=list)  # every call so far, in order
    final_answer: str | None = None  # the last submitted answer
    done: bool = False  # set once a call ended the episode

    def require_sandbox(self) -> Sandbox:
        """The sandbox; EnvConfigError when the episode was opened without one."""
        if self.sandbox is None:
            raise EnvConfigError(f"task {self.task.task_id!r} needs a sandbox for this tool, "
                                 "but the episode has none")
        return self.sandbox


class ToolInputError(EnvError):
    """Raised inside a tool body for a problem the model caused; `call` turns it into
    an error observation. Never escapes `Tool.call`."""


class ToolReplay(enum.Enum):
    """What a trajectory resumed after a restart (`treadle.agent.journal`) does with
    one of this tool's recorded calls, in a fresh episode: a tool's declaration."""

    # The call leaves nothing behind (reading, searching, answering): its recorded
    # result is all a resume needs; nothing runs again.
    NONE = "none"
    # Its effects (files written, a repo patched, an env stepped) are rebuilt by
    # running the recorded call again, in order with the others; the model still sees
    # the recorded result. For tools whose effects follow from their arguments.
    RERUN = "rerun"
    # Neither (state outside treadle's reach, an external server's): a resume keeps
    # only the turns before this tool's first call.
    OPAQUE = "opaque"


class Tool(ABC):
    """A function the model may call. Subclasses define the schema and `invoke`."""

    # How a resumed trajectory brings back this tool's calls; a tool that does not
    # say is OPAQUE (resuming never guesses that a call was harmless).
    replay: ClassVar[ToolReplay] = ToolReplay.OPAQUE

    @property
    @abstractmethod
    def name(self) -> str:
        """The function name the model writes."""

    @property
    @abstractmethod
    def description(self) -> str:
        """One paragraph for the model: what it does, its limits."""

    @property
    @abstractmethod
    def parameters(self) -> dict[str, Any]:
        """JSON schema (type object) of the arguments; checked before `invoke`."""

    @property
    def spec(self) -> dict[str, Any]:
        """`{"type": "function", "function": {name, description, parameters}}`."""
        return function_spec(self.name, self.description, self.parameters)

    async def call(self, arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        """Check `arguments`, run the tool, time it. See the module docstring for errors."""
        start = time.perf_counter()
        problems = check(self.parameters, dict(arguments) if isinstance(arguments, Mapping)
                         else arguments)
        if problems:
            result = ToolResult(error=f"invalid arguments for {self.name}: "
                                      + "; ".join(problems))
        else:
            try:
                result = await self.invoke(dict(arguments), ctx)
            except ToolInputError as e:
                result = ToolResult(error=str(e))
            except SandboxPathError as e:  # the model named a path outside the work dir
                result = ToolResult(error=f"bad path: {e}")
            except SandboxFileError as e:  # missing, not a regular file, too large
                result = ToolResult(error=str(e))
        result.latency_s = time.perf_counter() - start
        return result

    @abstractmethod
    async def invoke(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """The tool body; `arguments` already conform to `parameters`.

        Raise ToolInputError for the model's mistakes; let infrastructure errors
        propagate.
        """


def clip(text: str, max_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> str:
    """`text` cut to about `max_chars`, keeping the head and the tail (errors are at the end)."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    dropped = len(text) - head - tail
    return f"{text[:head]}\n... [{dropped} characters omitted] ...\n{text[-tail:]}"

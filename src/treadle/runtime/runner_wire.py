"""What the service and its runner actors send each other (`runtime.ray_runners`).

Two streams per runner actor, each a list of these messages per Ray call, in order:

- *to the runner* (`ToRunner`): the engines it may call (`Engines`), the weights
  served and whether calls may go (`Weights`), a hold to acknowledge (`Hold`), the
  suites its tasks name (`KeepSuite`, `DropSuite`), the sandbox servers its sandboxes
  may start on (`SandboxFleet`), the trajectories to run
  (`StartReplay`, `StartTask`, `Cancel`), the turns of trajectories driven from the
  service (a gateway session's: `OpenTurns`, `Generate`, `CancelCall`, `TurnDone`,
  `ToolBegan`, `ToolDone`, `TurnsEnded`), and the scheduler's decisions about them
  (`AdmitTurn`, `PreemptTurn`, `EngineLost`, `AbortForPause`, `FailTurn`), with the
  answers to its questions (`Answer`);
- *to the service* (`ToService`): each trajectory's scheduler events (`Told`), its
  calls (`CallStarted`, `CallEnded`, `CallFailed`: a question), its journal
  (`Sampled`, `Journaled`, `Resumed`), its work tree for the judges (`Captured`), a
  driven turn's reply (`Generated`),
  its end (`Done`: no more events; `Finished`: the record), and holds acknowledged
  (`Held`).

Engines travel as addresses (`EngineAddress`): a runner makes its own HTTP client of
each, as the service made its own; a journaled turn as its journal body (bytes). A
suite travels once per actor (`KeepSuite`, named by a key its tasks give), not with
each task: a suite of a corpus is tens of kilobytes. A batch travels `pack`ed: each
message (and a `Told`'s event) a tuple of a type code and its fields, since
unpickling a slotted dataclass costs a `fields()` walk per object, which showed as
the largest part of the service's CPU per turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from treadle.agent.journal import Resume, ResumeFrom
from treadle.agent.loop import AgentLimits
from treadle.agent.runner import Sampling, TurnOutput
from treadle.core import events
from treadle.core.events import Event
from treadle.engines.base import Engine
from treadle.engines.errors import EngineError
from treadle.envs.base import Suite
from treadle.envs.worktree import WorkTree, WorkTreeCapture
from treadle.types import KVAcrossUpdates, ResumePoint, Task, Trajectory
from treadle.workloads import TrajectorySpec

EngineKind = Literal["vllm", "emulated", "sglang"]


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """An engine of the pool, as a runner reaches it."""

    engine_id: str
    kind: EngineKind
    url: str
    model: str = ""  # the served model name (vLLM's API names it in every call)
    tokens_api: bool = False  # vLLM's token-in token-out API
    headers: tuple[tuple[str, str], ...] = ()  # e.g. its bearer token
    tp: int = 1
    max_batch: int = 256
    kv_capacity_tokens: int = 1 << 20
    label: str = ""


def engine_address(engine_id: str, engine: Engine, *, tp: int, max_batch: int,
                   kv_capacity_tokens: int, label: str) -> EngineAddress | None:
    """How a runner reaches `engine`; None for a client that is not one of treadle's
    HTTP clients (a runner cannot make its own of it)."""
    from treadle.engines.emulated_client import EmulatedEngineClient
    from treadle.engines.sglang import SGLangEngine
    from treadle.engines.vllm import VLLMEngine

    kind: EngineKind
    if isinstance(engine, EmulatedEngineClient):
        kind = "emulated"
    elif isinstance(engine, VLLMEngine):
        kind = "vllm"
    elif isinstance(engine, SGLangEngine):
        kind = "sglang"
    else:
        return None
    return EngineAddress(engine_id, kind, engine.base_url,
                         model=engine.model if isinstance(engine, VLLMEngine) else "",
                         tokens_api=isinstance(engine, VLLMEngine) and engine.tokens_api,
                         headers=engine.headers, tp=tp, max_batch=max_batch,
                         kv_capacity_tokens=kv_capacity_tokens, label=label)


def engine_client(address: EngineAddress) -> Engine:
    """A new client of the engine at `address`."""
    token = dict(address.headers).get("authorization", "").removeprefix("Bearer ") or None
    if address.kind == "sglang":
        from treadle.engines.sglang import SGLangEngine

        return SGLangEngine(address.url, api_key=token)
    if address.kind == "emulated":
        from treadle.engines.emulated_client import EmulatedEngineClient

        return EmulatedEngineClient(address.url, address.model, api_key=token)
    from treadle.engines.vllm import VLLMEngine

    return VLLMEngine(address.url, address.model, api_key=token,
                      tokens_api=address.tokens_api)


# -- to the runner ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Engines:
    """Engines joined (`added`, before the decisions of the batch are applied) and
    gone (`removed`, after them: a call on one is ended by its `EngineLost`)."""

    added: tuple[EngineAddress, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Weights:
    """The weights served now; `open`: engine calls may go."""

    policy_version: int
    cache_salt: str
    open: bool


@dataclass(frozen=True, slots=True)
class Hold:
    """Hold new engine calls, and say so (`Held`) after every call started before."""

    hold_id: int


@dataclass(frozen=True, slots=True)
class StartReplay:
    """Run a workload trajectory's script (`runtime.rollout.replay_task`)."""

    traj_id: str
    group_id: str
    repetition: int
    spec: TrajectorySpec
    task_id: str = ""
    attempt: int = 0
    kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
    resume: Resume | None = None  # planned by the service from its journal
    max_staleness: int | None = None
    journaled: bool = False  # send its journal back (`Sampled`, `Journaled`)


@dataclass(frozen=True, slots=True)
class KeepSuite:
    """A suite the tasks sent after it name by `key` (`StartTask.suite`)."""

    key: str
    suite: Suite


@dataclass(frozen=True, slots=True)
class DropSuite:
    """No task names the suite of `key` any more."""

    key: str


@dataclass(frozen=True, slots=True)
class SandboxFleet:
    """The sandbox servers new sandboxes may start on now (a fleet's: the runner's
    remote backend follows them, `RemoteBackend.follow`)."""

    accepting: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StartTask:
    """Run a suite task (`runtime.rollout.run_task`) in the runner's own sandbox pools,
    with its tokenizer."""

    traj_id: str
    group_id: str
    repetition: int
    suite: str  # the key of a suite sent before (`KeepSuite`)
    task: Task
    sampling: Sampling
    limits: AgentLimits
    chat_format: str
    attempt: int = 0
    kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
    resume: ResumeFrom | None = None  # planned there once its episode is up (`Resumed`)
    max_staleness: int | None = None
    journaled: bool = False  # send its journal back (`Sampled`, `Journaled`)
    capture: WorkTreeCapture | None = None  # read its work tree, send it back (`Captured`)


@dataclass(frozen=True, slots=True)
class Cancel:
    traj_id: str


@dataclass(frozen=True, slots=True)
class OpenTurns:
    """Make the runner of a trajectory whose conversation is the service's (a gateway
    session): its turns run here, each asked for by a `Generate`."""

    traj_id: str
    group_id: str
    kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE
    max_staleness: int | None = None


@dataclass(frozen=True, slots=True)
class Generate:
    """Run one turn of an opened trajectory (`TurnRunner.generate`); `call` numbers
    it for its answer (`Generated`)."""

    traj_id: str
    call: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: list[int]


@dataclass(frozen=True, slots=True)
class CancelCall:
    """The service gave up a `Generate` (its caller went away)."""

    traj_id: str
    call: int


@dataclass(frozen=True, slots=True)
class TurnDone:
    """`TurnRunner.turn_finished` of an opened trajectory."""

    traj_id: str
    output_tokens: int
    context_tokens: int
    final: bool


@dataclass(frozen=True, slots=True)
class ToolBegan:
    """`TurnRunner.tool_started` of an opened trajectory."""

    traj_id: str


@dataclass(frozen=True, slots=True)
class ToolDone:
    """`TurnRunner.tool_finished` of an opened trajectory."""

    traj_id: str
    latency_s: float
    output_tokens: int
    final: bool


@dataclass(frozen=True, slots=True)
class TurnsEnded:
    """`TurnRunner.ended` of an opened trajectory."""

    traj_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class AdmitTurn:
    traj_id: str
    engine_id: str
    priority: float


@dataclass(frozen=True, slots=True)
class PreemptTurn:
    traj_id: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class EngineLost:
    traj_id: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class AbortForPause:
    traj_id: str


@dataclass(frozen=True, slots=True)
class FailTurn:
    traj_id: str
    error: EngineError


@dataclass(frozen=True, slots=True)
class Answer:
    """The runtime's verdict on a failed call (`CallFailed`)."""

    query_id: int
    verdict: Literal["failed", "retry"]


ToRunner = (Engines | Weights | Hold | KeepSuite | DropSuite | SandboxFleet | StartReplay
            | StartTask | Cancel | OpenTurns | Generate | CancelCall | TurnDone | ToolBegan
            | ToolDone | TurnsEnded | AdmitTurn | PreemptTurn | EngineLost | AbortForPause
            | FailTurn | Answer)


# -- to the service ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Told:
    traj_id: str
    event: Event


@dataclass(frozen=True, slots=True)
class CallStarted:
    traj_id: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class CallEnded:
    traj_id: str
    engine_id: str
    sampled: int  # tokens its engines returned so far


@dataclass(frozen=True, slots=True)
class CallFailed:
    query_id: int
    traj_id: str
    engine_id: str
    error: EngineError


@dataclass(frozen=True, slots=True)
class Sampled:
    traj_id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Journaled:
    """A completed turn for the journal: its index, tokens and body
    (`JournaledTurn.encode`)."""

    traj_id: str
    index: int
    tokens: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Resumed:
    """A restarted attempt's resume, as its runner planned it (for the journal)."""

    traj_id: str
    point: ResumePoint


@dataclass(frozen=True, slots=True)
class Captured:
    """A task's work tree, read before its sandbox closed (`StartTask.capture`)."""

    traj_id: str
    tree: WorkTree | None
    error: str | None


@dataclass(frozen=True, slots=True)
class Generated:
    """A `Generate`'s answer: the reply, or the engine error it raised, or (`failure`)
    what else it raised, as text."""

    traj_id: str
    call: int
    output: TurnOutput | None
    error: EngineError | None = None
    failure: str = ""


@dataclass(frozen=True, slots=True)
class Done:
    traj_id: str


@dataclass(frozen=True, slots=True)
class Finished:
    """A trajectory's end: its record, or None when it was cancelled or its run
    raised (`error` says what; `raised`: the run raised, a bug rather than a loss)."""

    traj_id: str
    trajectory: Trajectory | None
    error: str = ""
    raised: bool = False


@dataclass(frozen=True, slots=True)
class Held:
    hold_id: int


ToService = (Told | CallStarted | CallEnded | CallFailed | Sampled | Journaled | Resumed
             | Captured | Generated | Done | Finished | Held)


_MESSAGES: tuple[type[Any], ...] = (
    Engines, Weights, Hold, KeepSuite, DropSuite, SandboxFleet, StartReplay, StartTask,
    Cancel, OpenTurns, Generate, CancelCall, TurnDone, ToolBegan, ToolDone, TurnsEnded,
    AdmitTurn, PreemptTurn, EngineLost, AbortForPause, FailTurn, Answer, Told, CallStarted,
    CallEnded, CallFailed, Sampled, Journaled, Resumed, Captured, Generated, Done, Finished,
    Held)
_EVENTS: tuple[type[Any], ...] = (
    events.TrajectoryArrived, events.TurnFinished, events.ToolCallStarted,
    events.ToolCallFinished, events.TurnPreempted, events.TrajectoryEnded)
_MESSAGE_CODE = {cls: i for i, cls in enumerate(_MESSAGES)}
_EVENT_CODE = {cls: i for i, cls in enumerate(_EVENTS)}
Packed = tuple[Any, ...]


def _fields(m: Any) -> tuple[Any, ...]:
    return tuple(getattr(m, name) for name in m.__slots__)


def pack(batch: list[Any]) -> list[Packed]:
    """`batch` (messages of this module) as tuples of plain values (module docstring)."""
    out: list[Packed] = []
    for m in batch:
        if isinstance(m, Told):
            out.append((_MESSAGE_CODE[Told], m.traj_id, _EVENT_CODE[type(m.event)],
                        *_fields(m.event)))
        else:
            out.append((_MESSAGE_CODE[type(m)], *_fields(m)))
    return out


def unpack(batch: list[Packed]) -> list[Any]:
    """The messages `pack` made `batch` of."""
    out: list[Any] = []
    for code, *values in batch:
        cls = _MESSAGES[code]
        if cls is Told:
            out.append(Told(values[0], _EVENTS[values[1]](*values[2:])))
        else:
            out.append(cls(*values))
    return out

"""One rollout's whole life: sandbox up, agent loop, reward, teardown.

    traj = await run_task(runtime, suite, task, traj_id="j1/q7/3", key=GroupKey("j1/q7", 3),
                          tokenizer=tok, sandboxes=pool)

ProRL Agent's stages, each failure attributed to one of them (`FailureStage`):

- **init**: the sandbox is started and the suite's setup runs (`open_episode`); a
  failure there ends the trajectory with status error, stage init, before any turn;
- **run**: the agent loop (`treadle.agent.loop.run_agent`) on the runtime's engines
  (stages engine and tool);
- **eval**: the suite's reward, with the sandbox still up (some rewards run tests in
  it); stage eval; then, where asked, the work tree is read for the judges;
- **teardown**: the episode and sandbox are released whatever happened; a failure
  there is logged and does not change a trajectory that is already complete.

`replay_task` is the same for a workload's trajectory script (`runtime.replay`): no
sandbox and no reward, only the engine calls; its record has the turns (counts,
engines, queued and generating seconds, the tool gaps as calls named "replay") and
no token ids (the tokens are synthetic).

Both return the trajectory and raise only `CancelledError`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from treadle.agent.chat import DEFAULT_FORMAT
from treadle.agent.journal import ResumePlan, TurnJournal
from treadle.agent.loop import AgentLimits, run_agent
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import Tokenizer
from treadle.clock import Clock
from treadle.engines.errors import EngineError
from treadle.envs.base import Suite, open_episode
from treadle.envs.worktree import WorkTreeCapture
from treadle.errors import TreadleError
from treadle.runtime.contract import TrajectoryHost
from treadle.runtime.replay import replay
from treadle.sandbox.base import SandboxBackend
from treadle.sandbox.pool import SandboxPool
from treadle.types import (
    FailureStage,
    GroupKey,
    KVAcrossUpdates,
    Task,
    Trajectory,
    TrajectoryStatus,
)
from treadle.workloads import TrajectorySpec

log = logging.getLogger(__name__)


async def run_task(runtime: TrajectoryHost, suite: Suite, task: Task, *, traj_id: str,
                   key: GroupKey,
                   tokenizer: Tokenizer, sandboxes: SandboxBackend | SandboxPool | None,
                   limits: AgentLimits | None = None, sampling: Sampling | None = None,
                   chat_format: str = DEFAULT_FORMAT, attempt: int = 0,
                   clock: Clock | None = None,
                   kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE,
                   journal: TurnJournal | None = None,
                   resume: ResumePlan | None = None,
                   capture: WorkTreeCapture | None = None,
                   judge: bool = False,
                   max_staleness: int | None = None) -> Trajectory:
    """One suite task, start to end, on the runtime's engines (see the module docstring;
    `runtime` may be a runner actor's host, `runtime.runner_actor`),
    its conversation in the chat format named `chat_format` (`agent.chat`). Its
    deadline and times are on `clock`, by default the runtime's; `kv`: what its calls
    after a weight update do with KV cached before it (recorded); `max_staleness`:
    its job's bound, for the scheduler (`Runtime.turns`). Its completed turns
    go to `journal`; a restarted attempt's `resume` is planned once its episode is up
    (the episode's tools say which recorded calls can come back: `agent.journal`).
    `capture`, when given, reads the episode's work tree after its reward, before its
    sandbox closes (`envs.worktree`: what a rubric's judges see of the change).
    `judge`: the episode is an agentic judge's, its turns of the scheduler's judge
    class (`runtime.agent_judges`)."""
    clock = clock or runtime.clock
    turns = runtime.turns(traj_id, key.group_id, kv, judge=judge,
                          max_staleness=max_staleness)
    try:
        started = clock.now()
        ran: list[Trajectory] = []  # the trajectory, once the agent loop has returned it
        async with contextlib.AsyncExitStack() as stack:
            stack.push(_log_teardown_failure(traj_id, ran))  # outermost: sees the teardown's
            try:
                episode = await stack.enter_async_context(open_episode(suite, task, sandboxes))
            except TreadleError as e:
                turns.ended("init failed")
                traj = Trajectory(traj_id, key, task_id=task.task_id,
                                  status=TrajectoryStatus.ERROR, failure_stage=FailureStage.INIT,
                                  reason=f"init: {type(e).__name__}: {e}", attempt=attempt,
                                  kv_across_updates=kv)
                traj.timings.started_at, traj.timings.finished_at = started, clock.now()
                return traj
            traj = await run_agent(episode, tokenizer, turns, traj_id=traj_id, key=key,
                                   limits=limits or AgentLimits(), sampling=sampling or Sampling(),
                                   chat_format=chat_format, clock=clock, journal=journal,
                                   resume=None if resume is None else resume(episode.replay_of))
            ran.append(traj)
            if capture is not None:
                await capture.take(episode)
        traj.attempt = attempt
        traj.kv_across_updates = kv
        return traj
    finally:
        # Whatever ended it (a cancelled job, a bug in a suite), the runtime forgets
        # the trajectory; a no-op once the agent loop has ended it.
        turns.ended("abandoned")


def _log_teardown_failure(traj_id: str, ran: list[Trajectory]) -> Callable[..., bool]:
    """Swallow (and log) whatever the teardown raises once the trajectory is complete:
    a cleanup that fails must not turn a finished, scored trajectory into an excluded
    one, or a policy could learn to escape a low reward by breaking its cleanup."""
    def exit_(exc_type: type[BaseException] | None, exc: BaseException | None,
              _tb: object) -> bool:
        if isinstance(exc, Exception) and (ran or isinstance(exc, TreadleError)):
            log.warning("trajectory %s: teardown failed: %s: %s", traj_id,
                        type(exc).__name__, exc)
            return True
        return False
    return exit_


async def replay_task(runtime: TrajectoryHost, spec: TrajectorySpec, *, traj_id: str, key: GroupKey,
                      task_id: str = "", attempt: int = 0,
                      kv: KVAcrossUpdates = KVAcrossUpdates.RECOMPUTE,
                      journal: TurnJournal | None = None,
                      resume: ResumePlan | None = None,
                      max_staleness: int | None = None) -> Trajectory:
    """A workload trajectory's script, replayed on the runtime's engines; `journal`,
    `resume` and `max_staleness` as for `run_task` (a replay calls no tools). `runtime`
    may be a runner actor's host (`runtime.runner_actor`)."""
    traj = Trajectory(traj_id, key, prompt_tokens=spec.prompt_tokens, task_id=task_id,
                      attempt=attempt, status=TrajectoryStatus.RUNNING, kv_across_updates=kv)
    traj.timings.started_at = runtime.clock.now()
    planned = None if resume is None else resume(None)
    if planned is not None:
        traj.resumed = list(planned.resumed)
    try:
        result = await replay(spec, runtime.turns(traj_id, key.group_id, kv,
                                                  max_staleness=max_staleness),
                              runtime.clock,
                              resume=() if planned is None else planned.turns,
                              journal=journal)
    except EngineError as e:
        traj.status, traj.failure_stage = TrajectoryStatus.ERROR, FailureStage.ENGINE
        traj.reason = f"engine: {e}"
    else:
        traj.status = TrajectoryStatus.COMPLETED
        traj.turns = list(result.turn_records)
        traj.timings.queue_s = result.queued_s
        traj.timings.llm_s = sum(t.generating_s for t in traj.turns)
        traj.timings.tool_s = sum(t.tool_call.latency_s for t in traj.turns if t.tool_call)
    traj.timings.finished_at = runtime.clock.now()
    return traj

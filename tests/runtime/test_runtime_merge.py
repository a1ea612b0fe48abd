"""treadle's tail merge carried out by the runtime (`core.policies.tail_merge`): idle
engines drained, one of their summed degree launched, and a turn running on a slow
engine paused and resumed on the new one with its tokens kept — on test doubles
(`FakeLauncher`, `FakeEngine`) and a fake clock."""

from __future__ import annotations

import asyncio

from runtime_helpers import FakeLauncher

from treadle.core.cost_model import CostModel
from treadle.core.policies import build_policy, parse_policy
from treadle.core.policies.treadle_policy import Treadle
from treadle.runtime.driver import Runtime
from treadle.runtime.replay import ReplayResult, replay
from treadle.sim.runner import outcomes
from treadle.testing import FakeClock
from treadle.workloads import TrajectorySpec, TurnSpec, Workload


def test_a_running_turn_moves_to_the_merged_engine_with_its_tokens() -> None:
    # Three short trajectories and one of a single 20,000-token turn: no tool gap to
    # move in, so the move pauses the running turn.
    specs = (*(TrajectorySpec(f"s{i}", f"g{i}", 200, (TurnSpec(100, 0.0, 0),))
               for i in range(3)),
             TrajectorySpec("long", "g9", 200, (TurnSpec(20_000, 0.0, 0),)))
    truth = dict(zip((t.traj_id for t in specs), outcomes(Workload("tail", specs)),
                     strict=True))
    policy = build_policy(parse_policy("oracle"), CostModel.named("qwen3-14b", "h100"),
                          batch_size=4, truth=truth, layout=(1, 1, 1, 1), max_batch=64)
    assert isinstance(policy, Treadle)
    clock = FakeClock(autojump=True)
    launcher = FakeLauncher(clock, startup_s=2.0, tokens_per_s=50.0)  # 400 s for the long

    async def main() -> list[ReplayResult]:
        runtime = Runtime(policy, launcher=launcher, gpus=4, clock=clock)
        await runtime.start()
        try:
            return list(await asyncio.gather(*(
                replay(t, runtime.turns(t.traj_id, t.group_id), clock) for t in specs)))
        finally:
            await runtime.close()

    results = asyncio.run(main())
    [merge] = policy.merges
    assert (merge.tp, len(merge.drain), merge.moved) == (2, 2, ("long",))
    # Four engines launched for the pool (e000-e003), the fifth (e004) by the merge,
    # split back into two TP-1 ones once the long trajectory was done.
    assert len(launcher.started) >= 5 and policy.splits == 1
    merged = launcher.started[4]
    [long] = [r for r in results if r.traj_id == "long"]
    assert long.output_tokens == 20_000  # every token once: those before the move kept
    [before] = [e for e in launcher.started[:4] if any(
        r.request_id.startswith("long") for r in e.requests)]
    assert [r.max_tokens for r in before.requests if r.request_id.startswith("long")] \
        == [20_000]
    resumed = [r for r in merged.requests if r.request_id.startswith("long")]
    assert len(resumed) == 1 and 0 < resumed[0].max_tokens < 20_000
    assert long.turn_records[0].engine_id == "e004"

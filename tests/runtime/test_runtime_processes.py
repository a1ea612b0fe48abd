"""The runtime over real engine processes (`treadle engine emulate`, over HTTP):
engines killed with SIGKILL mid-batch lose no trajectory and hang none — the
survivors or the relaunched replacements take the turns over, and with no engine
left and none relaunched every waiting trajectory ends with the reason."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from treadle.clock import ScaledClock
from treadle.core.cost_model import CostModel
from treadle.core.policies.baselines import Slime
from treadle.engines.errors import NoEngineAvailable
from treadle.runtime.driver import RelaunchPolicy, Runtime
from treadle.runtime.launcher import EmulatedProcess, LocalLauncher, VLLMProcess
from treadle.runtime.replay import replay
from treadle.workloads import generate

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SCALE = 0.02  # 50x faster than the modelled cluster


def _workload(n: int) -> Any:
    cost = CostModel.named("qwen3-14b", "h100")
    return generate("math", n, seed=3, group_size=4, max_context=cost.model.max_context)


async def _run(kill: str, relaunch: RelaunchPolicy | None,
               n: int = 16) -> tuple[list[Any], Runtime, list[Any]]:
    wl = _workload(n)
    clock = ScaledClock(SCALE)
    rt = Runtime(Slime(1, 1), launcher=LocalLauncher(EmulatedProcess(time_scale=SCALE)),
                 gpus=3, clock=clock, engine_wait_s=5.0, relaunch=relaunch)
    await rt.start()
    try:
        launched = [s.launched for s in rt.engines()]
        assert len(launched) == 3 and all(x is not None and x.pid for x in launched)
        jobs = [asyncio.ensure_future(replay(t, rt.turns(t.traj_id, t.group_id), clock))
                for t in wl.trajectories]
        while not all(s.calls for s in rt.engines()):  # mid-batch: every engine is busy
            await asyncio.sleep(0.01)
        victims = launched[:1] if kill == "one" else launched
        for x in victims:
            assert x is not None and x.pid is not None
            os.kill(x.pid, signal.SIGKILL)
        out = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 300)
    finally:
        await rt.close()
    return out, rt, list(wl.trajectories)


def test_an_engine_killed_mid_batch_loses_and_hangs_nothing() -> None:
    out, rt, specs = asyncio.run(_run("one", relaunch=None))
    assert [getattr(r, "output_tokens", r) for r in out] == [s.output_tokens for s in specs]
    assert len(rt.failures) == 1 and len(rt.engines()) == 2
    assert rt.live_trajectories == 0


def test_every_engine_killed_mid_batch_is_relaunched_and_every_trajectory_completes() -> None:
    out, rt, specs = asyncio.run(_run("all", relaunch=RelaunchPolicy()))
    assert [getattr(r, "output_tokens", r) for r in out] == [s.output_tokens for s in specs]
    assert len(rt.failures) == 3 and rt.pool.relaunched == 3
    assert rt.live_trajectories == 0


def test_with_every_engine_killed_each_trajectory_ends_with_the_reason() -> None:
    out, rt, specs = asyncio.run(_run("all", relaunch=None))
    errors = [r for r in out if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, NoEngineAvailable) for e in errors)
    assert all("no engine left" in str(e) for e in errors)
    for r, s in zip(out, specs, strict=True):  # finished before the kill: complete
        assert isinstance(r, BaseException) or r.output_tokens == s.output_tokens
    assert len(rt.failures) == 3 and rt.live_trajectories == 0


CRASHING_RUNTIME = """
import asyncio, os, sys
from treadle.runtime.launcher import EmulatedProcess, LocalLauncher

async def main():
    launched = await LocalLauncher(EmulatedProcess(time_scale=0.02)).start(1)
    print(launched.pid, flush=True)
    os._exit(1)  # dies without stopping its engine

asyncio.run(main())
"""


def test_engines_do_not_outlive_a_runtime_that_crashed() -> None:
    import select
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CRASHING_RUNTIME], capture_output=True,
                         text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    # Its end awaited as its pidfd: an engine that outlives its runtime hangs the test
    # (pytest-timeout's), not a guess at how long an end may take.
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([pidfd], [], [])
    finally:
        os.close(pidfd)


def test_vllm_starts_without_chunked_prefill_unless_asked() -> None:
    # The real-vLLM test of seeded requests (tests/engines) runs this command line.
    plain = VLLMProcess(model_dir="m", extra_args=("--enforce-eager",)).command(2, 8000, 0)
    assert "--no-enable-chunked-prefill" in plain and plain[-1] == "--enforce-eager"
    assert plain[plain.index("--tensor-parallel-size") + 1] == "2"
    chunked = VLLMProcess(model_dir="m", chunked_prefill=True).command(1, 8000, 0)
    assert "--no-enable-chunked-prefill" not in chunked
    assert "--tensor-parallel-size" not in chunked

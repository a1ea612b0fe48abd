"""A REAL vLLM engine (the CPU build serving the small trained model) started by
`RayLauncher` on a local Ray cluster, and suite tasks run through it: the engine is a
process of a Ray actor in a placement group of one GPU bundle (Ray lends the GPU it
is told the node has; vLLM's CPU build uses none), its URL handed to the runtime,
its turns token-exact, and stopping it releases the group and ends the process."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.sandbox_helpers import ended
from treadle.agent.loop import AgentLimits
from treadle.agent.runner import Sampling
from treadle.agent.tokenizer import HFTokenizer
from treadle.core.policies.baselines import Slime
from treadle.envs.registry import get_suite
from treadle.runtime.driver import Runtime
from treadle.runtime.launcher import VLLMProcess
from treadle.runtime.rollout import run_task
from treadle.types import GroupKey, Trajectory, TrajectoryStatus
from vllm_server import MAX_MODEL_LEN, MODEL, ensure_vllm

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.integration, pytest.mark.slow]
LENDS = {"treadle_engine": 1.0}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A one-node Ray cluster of this module's own (random ports), declaring one GPU;
    "local": a new one, never a cluster another test (or user) runs on this machine."""
    ray.init(address="local", num_cpus=2, num_gpus=1, resources=LENDS, include_dashboard=False,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_a_suite_job_runs_on_a_vllm_engine_ray_launched(
        local_ray: None, trained_checkpoint: Path) -> None:
    from treadle.runtime.ray_launcher import RayLauncher

    spec = VLLMProcess(model_dir=str(trained_checkpoint), served_name=MODEL,
                       python=str(ensure_vllm()), max_model_len=MAX_MODEL_LEN,
                       extra_args=("--enforce-eager",))
    # A loaded two-core machine starts vLLM in minutes: the launcher's bound for it is
    # pytest's timeout, not a guess.
    launcher = RayLauncher(spec, resources=LENDS, ready_timeout_s=600)
    suite = get_suite("math", python_tool=False)
    tasks = suite.tasks(2, seed=11)
    tok = HFTokenizer(trained_checkpoint)

    async def body() -> tuple[list[Trajectory], str, list[int], str]:
        runtime = Runtime(Slime(1, 1), launcher=launcher, gpus=1)
        await runtime.start()
        try:
            [slot] = list(runtime.engines())
            assert slot.launched is not None
            url = slot.launched.url
            node = launcher.placement(url).node_id
            engines = _processes_serving(url)
            assert engines, "no vLLM process listens on the launched engine's port"
            trajs = await asyncio.gather(*(
                run_task(runtime, suite, task, traj_id=f"ray-{i}", key=GroupKey("g", i),
                         tokenizer=tok, sandboxes=None,
                         limits=AgentLimits(max_turns=2, max_total_tokens=512),
                         sampling=Sampling(temperature=1.0, seed=i))
                for i, task in enumerate(tasks)))
        finally:
            await runtime.close()
        with pytest.raises(KeyError):  # stopped: its placement group released
            launcher.placement(url)
        return trajs, node, engines, url

    trajs, node, engines, url = asyncio.run(body())
    assert node == ray.get_runtime_context().get_node_id()  # the one node
    for traj in trajs:
        assert traj.status is TrajectoryStatus.COMPLETED, traj.reason
        assert traj.turns and all(t.output_tokens > 0 for t in traj.turns)
    # Stopped with the runtime, the engine's processes end (awaited as their pidfds).
    ended(lambda: [pid for pid in _processes_serving(url) if pid in engines])


def _processes_serving(url: str) -> list[int]:
    """Host processes whose command line names `url`'s port after --port (vLLM's)."""
    port = url.rsplit(":", 1)[1].split("/")[0]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and \
                any(a == b"--port" and b == port.encode() for a, b in itertools.pairwise(argv)):
            found.append(int(pid))
    return found

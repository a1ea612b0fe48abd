"""The agent loop on an image task: a scripted model fixes the built-in swe-images instance
(six, in its own Debian image, built on first use) through real bwrap, and the
trajectory keeps the per-test outcomes of the grading."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import FakeScriptedRunner, build_tokenizer

from treadle.agent.chat import Call, HermesFormat
from treadle.agent.loop import AgentLimits, run_agent
from treadle.agent.tokenizer import HFTokenizer
from treadle.envs import open_episode
from treadle.envs.suites.swe_images import SweImageSuite
from treadle.sandbox import BwrapBackend
from treadle.types import GroupKey, TrajectoryStatus

F2P = "test_six.py::test_add_metaclass_nested"


def _call(name: str, **arguments: Any) -> str:
    return HermesFormat().reply_text("", [Call.of(name, arguments)])


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("fixed", [True, False], ids=["gold-patch", "no-edit"])
def test_a_scripted_model_on_an_image_task(tok: HFTokenizer, fixed: bool,
                                           tmp_path: Path) -> None:
    suite = SweImageSuite(grade_timeout_s=120)
    task = suite.tasks(seed=0)[0]
    replies = [_call("bash", command="python3 -m pytest -q -x test_six.py 2>&1 | tail -1")]
    if fixed:
        replies.append(_call("apply_patch", patch=task.metadata["patch"]))
    replies.append(_call("submit_answer", answer="add_metaclass keeps __qualname__"))
    runner = FakeScriptedRunner(tok, replies)
    root = tempfile.mkdtemp(prefix="treadle-agent-swe-", dir="/tmp")
    os.chmod(root, 0o711)

    async def go() -> Any:
        async with open_episode(suite, task, BwrapBackend(work_root=root)) as ep:
            # The test tokenizer is trained on a tiny corpus: a patch takes many tokens.
            traj = await run_agent(ep, tok, runner, traj_id="swe/t0", key=GroupKey("swe", 0),
                                   limits=AgentLimits(max_total_tokens=32768,
                                                      max_tokens_per_turn=8192))
            return traj, ep.history[0].result.output

    try:
        traj, ran = asyncio.run(asyncio.wait_for(go(), 240))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert "passed" in ran  # the agent's pytest ran in the image (the host has no six tests)
    assert traj.status is TrajectoryStatus.COMPLETED
    assert traj.reward == (1.0 if fixed else 0.0)
    assert traj.metrics[f"F2P {F2P}"] == (1.0 if fixed else 0.0)
    assert traj.metrics["P2P test_six.py::test_add_metaclass"] == 1.0
    assert traj.metrics["pass_to_pass_total"] == 6.0

"""A real-repository SWE task end to end on REAL vLLM (the CPU build, the shared
`served` engine serving the small trained model) in a REAL bwrap sandbox on the task's
own image: the `swe-images` suite's built-in instance (six 1.17.0 with a reverted fix,
in a Debian image built once and cached), through a service with sandboxes.

What is checked is the plumbing, not the fix (the model was trained on arithmetic; its
answers fail): the sandbox started on the instance's image, the agent's turns went to
vLLM with each prompt the episode so far, the instance's tests ran inside the image
after the agent's turns and graded the trajectory from FAIL_TO_PASS/PASS_TO_PASS, and
the record is stored. That the gold patch resolves the instance is shown with a
scripted agent (tests/envs/test_envs_swe_images.py).

The problem statement is cut to its title here: the instance's whole prompt
with its six tools is 1,397 tokens of this model's tokenizer, over its 1,024 positions.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path

import httpx
import pytest

from gateway.gateway_real import TOKEN, Served, sandboxed_service
from treadle.client import RolloutClient
from treadle.envs.suites.swe_builtin import builtin_dir, builtin_records
from treadle.types import TrajectoryStatus

pytestmark = [pytest.mark.integration]


def test_a_swe_image_task_runs_on_vllm_and_is_graded_in_its_image(
        served: Served, trained_checkpoint: Path) -> None:
    (record,) = builtin_records()  # the image built (or found in the cache)
    short = {**record, "problem_statement": record["problem_statement"].splitlines()[0]}
    data = Path(tempfile.mkdtemp(prefix="treadle-swe-real-", dir="/tmp"))
    (data / "instances.jsonl").write_text(json.dumps(short) + "\n")
    roots = (str(data), str(builtin_dir()))
    with sandboxed_service(served, trained_checkpoint, roots) as (url, engine):
        created = httpx.post(f"{url}/v1/jobs", headers={"authorization": f"Bearer {TOKEN}"},
                             json={"tasks": {"suite": "swe-images", "count": 1,
                                             "options": {"instances": str(
                                                 data / "instances.jsonl")}},
                                   "samples_per_task": 1,
                                   "limits": {"max_turns": 2, "max_tokens_per_turn": 48,
                                              "max_total_tokens": 1024},
                                   "sampling": {"temperature": 1.0, "seed": 5},
                                   "job_id": "swe-real"})
        assert created.status_code == 201, created.text
        with RolloutClient(url, token=TOKEN) as client:
            (traj,) = [d.trajectory for d in client.trajectories("swe-real", follow=True)]
            stored = client.job("swe-real")
    assert traj.status is not TrajectoryStatus.ERROR, traj.reason
    calls = [(req, res) for req, res in engine.calls
             if req.request_id.startswith(traj.trajectory_id)]
    assert calls and len(traj.turns) == len(calls)
    for (req, res), (after, _) in itertools.pairwise(calls):  # the episode so far
        assert after.prompt_ids[:len(req.prompt_ids) + len(res.output_ids)] == \
            req.prompt_ids + res.output_ids
    # The instance's tests ran in its image after the agent's turns: every named test
    # has an outcome; the bug is still there, so FAIL_TO_PASS fails and it is unresolved.
    named = [f"F2P {t}" for t in record["FAIL_TO_PASS"]] + \
        [f"P2P {t}" for t in record["PASS_TO_PASS"]]
    assert set(named) <= set(traj.metrics), sorted(traj.metrics)
    assert all(traj.metrics[f"F2P {t}"] == 0.0 for t in record["FAIL_TO_PASS"])
    assert traj.reward == 0.0
    # The repository's other tests pass there (this seed's two short turns broke none):
    # they ran where six and pytest are, the image, not the host's system dirs.
    assert all(traj.metrics[f"P2P {t}"] == 1.0 for t in record["PASS_TO_PASS"])
    assert stored.delivered == 1  # in the store, as any job's
    print(f"swe-images on vLLM: {len(calls)} turns, P2P passed "
          f"{sum(traj.metrics[f'P2P {t}'] for t in record['PASS_TO_PASS']):.0f} of "
          f"{len(record['PASS_TO_PASS'])}")

"""Policy versions per trainer: a job states the weights it is for (a version range,
a trainer run) and is refused, or ends its unstarted trajectories, rather than be
sampled from other weights; the trainer's measurements are kept in the job's view.
Weight updates here are the barrier's pause/resume (emulated engines load nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_helpers import running_service

from treadle.client import RolloutClient, ServiceError, replay_tasks
from treadle.service.state import ServiceConfig
from treadle.types import FailureStage, TrajectoryStatus

pytestmark = [pytest.mark.integration]
TOKEN = "versions-token"
TASKS = replay_tasks("math", trajectories=4, seed=1, group_size=2)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[RolloutClient]:
    config = ServiceConfig(db=str(tmp_path / "v.db"), token=TOKEN, emulate=1,
                           time_scale=0.005, policy="verl")
    with running_service(config) as url, RolloutClient(url, token=TOKEN) as c:
        yield c


def _push(client: RolloutClient, version: int, run: str | None) -> None:
    client.pause()
    state = client.resume(version, trainer_run=run)
    assert (state.policy_version, state.trainer_run) == (version, run)


def _statuses(client: RolloutClient, job_id: str) -> list[TrajectoryStatus]:
    return [d.trajectory.status for d in client.trajectories(job_id)]


def test_a_restarted_trainer_is_refused_the_previous_runs_weights(
        client: RolloutClient) -> None:
    # A long-lived service still serves run-a's step 25 when run-b starts from step 0.
    _push(client, 25, "run-a")
    with pytest.raises(ServiceError) as refused:
        client.submit(tasks=TASKS, min_policy_version=0, max_policy_version=0,
                      trainer_run="run-b")
    assert refused.value.status == 409
    assert "version 25 of trainer run 'run-a', not of trainer run 'run-b'" in str(
        refused.value)
    # The same run past the job's version: refused too (its tokens would be off-policy).
    with pytest.raises(ServiceError, match="past this job's max_policy_version 3"):
        client.submit(tasks=TASKS, min_policy_version=3, max_policy_version=3,
                      trainer_run="run-a")
    # Once run-b pushes its weights, its job runs on exactly them.
    _push(client, 0, "run-b")
    job = client.submit(tasks=TASKS, min_policy_version=0, max_policy_version=0,
                        trainer_run="run-b")
    assert set(_statuses(client, job.job_id)) == {TrajectoryStatus.COMPLETED}
    trajs = [d.trajectory for d in client.trajectories(job.job_id)]
    assert {t.policy_version for traj in trajs for t in traj.turns} == {0}
    view = client.job(job.job_id)
    assert (view.min_policy_version, view.max_policy_version, view.trainer_run) == (
        0, 0, "run-b")


def test_a_waiting_job_the_engines_move_past_ends_its_trajectories_as_engine_failures(
        client: RolloutClient) -> None:
    _push(client, 5, "run-a")
    job = client.submit(tasks=TASKS, min_policy_version=6, max_policy_version=6,
                        trainer_run="run-a")
    assert client.job(job.job_id).queued == 4  # waiting for version 6
    _push(client, 7, "run-a")  # version 6 never came
    trajs = [d.trajectory for d in client.trajectories(job.job_id)]
    assert [t.status for t in trajs] == [TrajectoryStatus.ERROR] * 4
    assert {t.failure_stage for t in trajs} == {FailureStage.ENGINE}
    assert "past this job's max_policy_version 6" in (trajs[0].reason or "")
    view = client.job(job.job_id)
    assert view.status == "completed" and view.infrastructure_failures == 4


def test_a_waiting_job_starts_on_its_version_and_the_initial_weights_serve_any_run(
        client: RolloutClient) -> None:
    # Nobody pushed weights yet: version 0 is the engines' own, any run may start on it.
    first = client.submit(tasks=TASKS, max_policy_version=0, trainer_run="run-c")
    assert set(_statuses(client, first.job_id)) == {TrajectoryStatus.COMPLETED}
    later = client.submit(tasks=TASKS, min_policy_version=1, max_policy_version=1,
                          trainer_run="run-c")
    assert client.job(later.job_id).queued == 4
    _push(client, 1, "run-c")
    trajs = [d.trajectory for d in client.trajectories(later.job_id)]
    assert {t.status for t in trajs} == {TrajectoryStatus.COMPLETED}
    assert {t.policy_version for traj in trajs for t in traj.turns} == {1}


def test_a_trainers_reports_are_kept_in_the_jobs_view(client: RolloutClient) -> None:
    job = client.submit(tasks=TASKS)
    assert client.job(job.job_id).trainer_metrics == {}
    client.report(job.job_id, {"logprob_gap_max": 0.25, "logprob_gap_mean": 0.01})
    view = client.report(job.job_id, {"logprob_gap_max": 0.0004})
    assert view.trainer_metrics == {"logprob_gap_max": 0.0004, "logprob_gap_mean": 0.01}
    assert client.job(job.job_id).trainer_metrics == view.trainer_metrics
    bad = httpx.post(f"{client.url}/v1/jobs/{job.job_id}/metrics",
                     content=b'{"metrics": {"gap": NaN}}',
                     headers={"authorization": f"Bearer {TOKEN}",
                              "content-type": "application/json"})
    assert bad.status_code == 422
    with pytest.raises(ServiceError) as unknown:
        client.report("no-such-job", {"gap": 0.0})
    assert unknown.value.status == 404
    # A window below itself is a field error.
    with pytest.raises(ServiceError) as inverted:
        client.submit(tasks=TASKS, min_policy_version=3, max_policy_version=2)
    assert inverted.value.status == 422


def test_a_windowed_job_starts_nothing_while_weights_change(client: RolloutClient) -> None:
    # Started during the pause, a trajectory would sample on whatever comes next.
    _push(client, 5, "run-a")
    client.pause()
    job = client.submit(tasks=TASKS, min_policy_version=5, max_policy_version=5,
                        trainer_run="run-a")
    view = client.job(job.job_id)
    assert (view.running, view.queued) == (0, 4)
    client.resume(6, trainer_run="run-a")  # the update went past the job's version
    trajs = [d.trajectory for d in client.trajectories(job.job_id)]
    assert {t.status for t in trajs} == {TrajectoryStatus.ERROR} and not any(
        t.turns for t in trajs)


def test_a_job_below_its_window_again_waits_again(client: RolloutClient) -> None:
    # run-b restarts at version 0 while run-a's version-5 job waits for a slot: it
    # must not start on run-b's weights, nor below its version.
    _push(client, 5, "run-a")
    client.pause()
    job = client.submit(tasks=TASKS, min_policy_version=5)  # no run named: any run's
    client.resume(0, trainer_run="run-b")
    assert client.job(job.job_id).queued == 4
    _push(client, 5, "run-b")
    assert {d.trajectory.status for d in client.trajectories(job.job_id)} == {
        TrajectoryStatus.COMPLETED}

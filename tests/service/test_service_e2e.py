"""The service over real HTTP (uvicorn on loopback, httpx): jobs of replayed
workload trajectories on emulated engine processes, streamed back as NDJSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service

from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration]
TOKEN = "test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _config(tmp_path: Path, **kw: Any) -> ServiceConfig:
    return ServiceConfig(db=str(tmp_path / "t.db"), token=TOKEN, emulate=2, time_scale=0.02,
                         policy="verl", **kw)


def _lines(client: httpx.Client, job: str, after: int = 0) -> list[dict[str, Any]]:
    with client.stream("GET", f"/v1/jobs/{job}/trajectories",
                       params={"after": after, "follow": "true"}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


def test_a_replay_job_streams_every_trajectory_once_in_completion_order(
        tmp_path: Path) -> None:
    with running_service(_config(tmp_path)) as url, \
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 32,
                                                    "group_size": 16}, "job_id": "j1"})
        assert r.status_code == 201, r.text
        assert r.json() == {"job_id": "j1", "planned": 32}
        lines = _lines(client, "j1")
        assert [x["seq"] for x in lines] == list(range(1, 33))
        records = [x["trajectory"] for x in lines]
        assert len({t["trajectory_id"] for t in records}) == 32
        assert all(t["status"] == "completed" and t["output_tokens"] > 0 for t in records)
        assert {t["group_id"] for t in records} == {"j1/math-s0-g0000", "j1/math-s0-g0001"}
        finished = [t["timings"]["finished_at"] for t in records]
        assert finished == sorted(finished)  # completion order
        view = client.get("/v1/jobs/j1").json()
        assert view["status"] == "completed" and view["delivered"] == 32
        assert view["counts"]["completed"] == 32 and view["progress"] == 1.0
        # Resuming from a cursor gives exactly the rest.
        assert [x["seq"] for x in _lines(client, "j1", after=30)] == [31, 32]
        metrics = client.get("/metrics").text
        assert 'treadle_trajectories_finished_total{status="completed"} 32' in metrics
        assert "treadle_engines 2" in metrics


def test_bad_requests_are_refused_with_field_level_messages(tmp_path: Path) -> None:
    with running_service(_config(tmp_path)) as url, \
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 0}})
        assert r.status_code == 422
        locs = [tuple(d["loc"]) for d in r.json()["detail"]]
        assert any("trajectories" in loc for loc in locs), locs
        r = client.post("/v1/jobs", json={"tasks": {"suite": "math", "count": 2}})
        assert r.status_code == 422 and "tokenizer" in r.text  # replay-only service
        r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 4},
                                          "bogus": 1})
        assert r.status_code == 422 and "bogus" in r.text
        r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 4},
                                          "sampling": {"seed": -1}})
        assert r.status_code == 422 and ["body", "sampling", "seed"] in [
            d["loc"] for d in r.json()["detail"]]
        assert client.get("/v1/jobs/nope").status_code == 404
        assert client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 16},
                                             "job_id": "dup"}).status_code == 201
        assert client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 16},
                                             "job_id": "dup"}).status_code == 409
        assert httpx.get(f"{url}/v1/jobs/dup").status_code == 401
        assert httpx.get(f"{url}/healthz").status_code == 200
        big = client.post("/v1/jobs", content=b"x" * (65 << 20),
                          headers={"content-type": "application/json"})
        assert big.status_code == 413


def test_cancel_aborts_what_is_unfinished(tmp_path: Path) -> None:
    # Four short trajectories and one in a tool call of a week: the cancel comes once
    # the short ones are delivered, whatever the machine's speed, and the long one is
    # still running then.
    short = [{"id": f"s{i}", "group": "g", "prompt_tokens": 8,
              "turns": [{"output_tokens": 4, "tool_latency_s": 0, "tool_output_tokens": 0}]}
             for i in range(4)]
    long = {"id": "long", "group": "g", "prompt_tokens": 8,
            "turns": [{"output_tokens": 4, "tool_latency_s": 7 * 86400.0,
                       "tool_output_tokens": 1},
                      {"output_tokens": 4, "tool_latency_s": 0, "tool_output_tokens": 0}]}
    with running_service(_config(tmp_path)) as url, \
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        r = client.post("/v1/jobs", json={"tasks": {"trace": [*short, long]}, "job_id": "c1"})
        assert r.status_code == 201, r.text
        with client.stream("GET", "/v1/jobs/c1/trajectories", params={"follow": "true"},
                           timeout=120) as stream:
            lines = stream.iter_lines()
            for _ in range(4):  # the short ones, as they are delivered
                assert json.loads(next(lines))["trajectory"]["status"] == "completed"
        assert client.get("/v1/jobs/c1").json()["running"] == 1
        view = client.post("/v1/jobs/c1/cancel").json()
        assert view["status"] == "cancelled"
        records = [x["trajectory"] for x in _lines(client, "c1")]
        assert len(records) == 5
        assert [t["status"] for t in records if t["trajectory_id"] == "c1/long"] == ["aborted"]
        assert client.get("/v1/jobs/c1").json()["running"] == 0


def test_with_emulated_engines_tool_latencies_run_on_the_scaled_clock(tmp_path: Path) -> None:
    # The runtime's clock was the wall clock whatever --time-scale said: a replayed
    # tool slept its modelled seconds in real seconds (here 200 s, not 4 s).
    line = {"id": "t", "group": "g", "prompt_tokens": 16, "turns": [
        {"output_tokens": 8, "tool_latency_s": 200.0, "tool_output_tokens": 8},
        {"output_tokens": 8, "tool_latency_s": 0, "tool_output_tokens": 0}]}
    with running_service(_config(tmp_path)) as url, \
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        r = client.post("/v1/jobs", json={"tasks": {"trace": [line]}, "job_id": "slow-tool"})
        assert r.status_code == 201, r.text
        with client.stream("GET", "/v1/jobs/slow-tool/trajectories",
                           params={"follow": "true"}, timeout=60) as stream:
            [record] = [json.loads(x)["trajectory"] for x in stream.iter_lines() if x]
        assert record["status"] == "completed"
        timings = record["timings"]
        assert timings["finished_at"] - timings["started_at"] >= 200.0  # modelled seconds

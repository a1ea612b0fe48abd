"""Hostile and careless requests over real HTTP, one regression test each: files named
by suite options, bodies read before authentication, 500s for input that is merely
bad, unbounded error echoes, engines serving another model, unaddressable job
ids."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from service_helpers import running_service

from agent.agent_helpers import build_tokenizer
from treadle.cli import main
from treadle.client.stream import RESTART_HEADER, RestartWatch, Retries, RetryPolicy
from treadle.core.cost_model import CostModel
from treadle.engines.emulated import EmulatedEngine
from treadle.engines.emulated_server import serve_in_thread
from treadle.envs.registry import _BUILTIN
from treadle.service import limits
from treadle.service.state import ServiceConfig

pytestmark = [pytest.mark.integration]
TOKEN = "abuse-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ROW = {"responses_create_params": {"input": "hi"}, "expected_answer": "x"}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "rows.jsonl").write_text(json.dumps(ROW) + "\n")
    (root / "corpus.jsonl").write_text(json.dumps({"id": "d1", "text": "Oslo is in Norway."})
                                       + "\n")
    (root / "sub").mkdir()
    os.mkfifo(root / "fifo")
    (root / "escape").symlink_to("/etc/hostname")
    return root


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Iterator[str]:
    work = tmp_path_factory.mktemp("abuse")
    build_tokenizer(work / "tok")
    config = ServiceConfig(db=str(work / "t.db"), token=TOKEN, policy="verl",
                           tokenizer=str(work / "tok"), max_body_bytes=1 << 20,
                           max_requests=4, data_roots=(str(data_root),),
                           max_data_file_bytes=1 << 16)
    with running_service(config) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        yield c


def _nemo(**options: Any) -> dict[str, Any]:
    return {"tasks": {"suite": "nemo_gym", "count": 1,
                      "options": {"base_url": "http://127.0.0.1:9", **options}}}


def _field_error(r: httpx.Response) -> tuple[tuple[Any, ...], str]:
    assert r.status_code == 422, r.text
    [entry] = r.json()["detail"]
    return tuple(entry["loc"]), entry["msg"]


# -- files a job names --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/dev/zero", "/etc/shadow", "/no/such/file", "relative.jsonl"])
def test_a_file_outside_the_data_roots_is_refused_alike_whether_it_exists_or_not(
        client: httpx.Client, path: str) -> None:
    # /dev/zero drove the service to 2 GB; 500 against 422 told which paths exist.
    loc, msg = _field_error(client.post("/v1/jobs", json=_nemo(rows_path=path)))
    assert loc == ("body", "tasks", "options", "rows_path")
    assert "data roots" in msg


def test_a_link_out_of_the_root_fifo_or_directory_inside_it_is_refused(
        client: httpx.Client, data_root: Path) -> None:
    for name, words in (("escape", "symbolic link"), ("fifo", "regular file"),
                        ("sub", "regular file")):
        loc, msg = _field_error(client.post("/v1/jobs",
                                            json=_nemo(rows_path=str(data_root / name))))
        assert loc == ("body", "tasks", "options", "rows_path") and words in msg, (name, msg)


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(
        client: httpx.Client, data_root: Path) -> None:
    big = data_root / "big.jsonl"
    with big.open("wb") as f:
        f.truncate(1 << 20)  # sparse: a megabyte that takes no disk
    _, msg = _field_error(client.post("/v1/jobs", json=_nemo(rows_path=str(big))))
    assert "over the" in msg


def test_a_file_under_a_root_is_read(client: httpx.Client, data_root: Path) -> None:
    r = client.post("/v1/jobs", json=_nemo(rows_path=str(data_root / "rows.jsonl")))
    assert r.status_code == 201, r.text
    client.post(f"/v1/jobs/{r.json()['job_id']}/cancel")


def test_every_option_of_a_built_in_suite_that_takes_a_path_is_fenced() -> None:
    # search's `corpus` was read from anywhere: the fence knew only nemo_gym's rows.
    for name, target in _BUILTIN.items():
        module, _, attribute = target.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
        takes_path = {p.name for p in inspect.signature(factory).parameters.values()
                      if "Path" in str(p.annotation)}
        assert takes_path <= set(getattr(factory, "file_options", ())), (name, takes_path)


def test_the_search_corpus_is_fenced_too(client: httpx.Client, data_root: Path) -> None:
    def job(corpus: str) -> dict[str, Any]:
        return {"tasks": {"suite": "search", "options": {"corpus": corpus,
                                                        "python_tool": False},
                          "tasks": [{"id": "q1", "question": "Where is Oslo?",
                                     "answers": ["Norway"]}]}}
    loc, msg = _field_error(client.post("/v1/jobs", json=job("/etc/passwd")))
    assert loc == ("body", "tasks", "options", "corpus") and "data roots" in msg
    r = client.post("/v1/jobs", json=job(str(data_root / "corpus.jsonl")))
    assert r.status_code == 201, r.text  # inline tasks on a corpus under a root
    client.post(f"/v1/jobs/{r.json()['job_id']}/cancel")


def test_an_image_a_swe_task_names_must_lie_under_a_data_root(client: httpx.Client,
                                                              data_root: Path) -> None:
    # A root file system dir may be any dir with a usr/: "/" would show the host's root.
    from treadle.envs.suites.swe_builtin import builtin_specs

    [spec] = builtin_specs().values()
    for name, image in (("swe-out.jsonl", "/"), ("swe-link.jsonl", "escape"),
                        ("swe-in.jsonl", "images/six.oci")):
        (data_root / name).write_text(json.dumps({**spec["instance"], "image": image}) + "\n")
    for name in ("swe-out.jsonl", "swe-link.jsonl"):
        r = client.post("/v1/jobs", json={"tasks": {"suite": "swe-images", "count": 1, "options": {
            "instances": str(data_root / name)}}})
        assert r.status_code == 422 and "not under the service's data roots" in r.text, r.text
    inline = {**spec["instance"], "image": "/usr/.."}
    r = client.post("/v1/jobs", json={"tasks": {"suite": "swe-images", "tasks": [inline]}})
    assert r.status_code == 422 and "not under the service's data roots" in r.text, r.text
    r = client.post("/v1/jobs", json={"tasks": {"suite": "swe-images", "count": 1, "options": {
        "instances": str(data_root / "swe-in.jsonl")}}})
    assert "data roots" not in r.text, r.text  # under the root (the service has no sandbox)
    if r.status_code == 201:
        client.post(f"/v1/jobs/{r.json()['job_id']}/cancel")


def test_inline_tasks_of_a_suite_without_bundled_ones_are_planned(client: httpx.Client
                                                                  ) -> None:
    # Planning asked every suite for a generated task first, and nemo_gym without rows
    # has none: its inline tasks were refused.
    body = _nemo()
    del body["tasks"]["count"]
    body["tasks"]["tasks"] = [ROW]
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    client.post(f"/v1/jobs/{r.json()['job_id']}/cancel")


def test_rows_that_are_not_objects_and_deep_nesting_are_422s(client: httpx.Client) -> None:
    # An AttributeError in the suite's constructor, and pydantic giving up on a
    # deeply nested value when the request was stored: both were 500s.
    assert _field_error(client.post("/v1/jobs", json=_nemo(rows=[1])))[0] == \
        ("body", "tasks", "options")
    deep: Any = 1
    for _ in range(900):
        deep = [deep]
    r = client.post("/v1/jobs", json={"tasks": {"suite": "math", "count": 1,
                                                "options": {"x": deep}}})
    assert _field_error(r)[0] == ("body",)


def test_without_data_roots_no_file_may_be_named(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "tok")
    config = ServiceConfig(db=str(tmp_path / "t.db"), policy="verl",
                           tokenizer=str(tmp_path / "tok"))
    with running_service(config) as base:
        r = httpx.post(f"{base}/v1/jobs", json=_nemo(rows_path="/etc/hostname"))
    _, msg = _field_error(r)
    assert "--data-root" in msg


# -- bad input is a 422, and a bounded one ------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_non_finite_number_anywhere_is_a_422(client: httpx.Client, number: str) -> None:
    # The 422 itself could not be serialised (its echo held the NaN): a 500.
    for body in (f'{{"tasks": {{"workload": "math", "trajectories": 16}}, '
                 f'"sampling": {{"temperature": {number}}}}}',
                 f'{{"tasks": {{"suite": "math", "count": 1, "options": {{"x": {number}}}}}}}'):
        r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert _field_error(r)[0] == ("body",), body


def test_a_lone_surrogate_in_a_string_is_a_422(client: httpx.Client) -> None:
    body = '{"tasks": {"suite": "math", "count": 1, "options": {"\\ud800": 1}}}'
    r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert _field_error(r)[0] == ("body",)


@pytest.mark.parametrize("options", [
    {"kinds": ["x"]},  # the suite's own ValueError
    {"no_such_option": 1},  # TypeError of its constructor
])
def test_a_suite_refusing_its_options_is_a_422(client: httpx.Client,
                                               options: dict[str, Any]) -> None:
    r = client.post("/v1/jobs", json={"tasks": {"suite": "math", "count": 1,
                                                "options": options}})
    assert _field_error(r)[0] == ("body", "tasks", "options")


def test_generated_tasks_of_nemo_gym_without_rows_are_a_422(client: httpx.Client) -> None:
    loc, msg = _field_error(client.post("/v1/jobs", json=_nemo()))
    assert loc == ("body", "tasks", "count") and "nemo_gym" in msg


def test_an_error_echoes_a_bounded_part_of_a_huge_bad_field(client: httpx.Client) -> None:
    # A 30 MiB bad field came back whole in the 422 and froze the loop 10.7 s.
    r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 16},
                                      "job_id": "x" * 900_000})
    assert r.status_code == 422 and len(r.content) < 4096, len(r.content)
    many = client.post("/v1/jobs", json={"tasks": {"trace": [{"id": 1}] * 5000}})
    assert many.status_code == 422 and len(many.content) < 16384, len(many.content)


@pytest.mark.parametrize("job_id", [".", ".."])
def test_job_ids_no_url_can_name_are_refused(client: httpx.Client, job_id: str) -> None:
    r = client.post("/v1/jobs", json={"tasks": {"workload": "math", "trajectories": 16},
                                      "job_id": job_id})
    assert _field_error(r)[0] == ("body", "job_id")


# -- authentication comes before the body -------------------------------------------------


def _send_headers(url: str, headers: dict[str, str], length: int) -> socket.socket:
    """A POST whose headers announce `length` body bytes, none of which is sent."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    sock = socket.create_connection((host, port))
    lines = ["POST /v1/jobs HTTP/1.1", f"host: {host}", "content-type: application/json",
             f"content-length: {length}", *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def _status(sock: socket.socket) -> int:
    sock.settimeout(60)  # a bound for a hang, not a measure: the answer comes at once
    head = sock.recv(65536).split(b"\r\n", 1)[0]
    return int(head.split()[1])


def test_an_unauthorised_request_is_answered_before_its_body_is_read(url: str) -> None:
    # Bodies were read (8 x 60 MiB: 846 MiB) before the token was checked.
    sock = _send_headers(url, {}, 1 << 19)
    try:
        assert _status(sock) == 401
    finally:
        sock.close()


def test_unauthorised_slow_bodies_take_no_request_slot(url: str, client: httpx.Client) -> None:
    # 300 slow unauthenticated bodies held all 256 slots: every authorised call got 503.
    socks = [_send_headers(url, {}, 1 << 19) for _ in range(8)]  # max_requests is 4
    try:
        assert [_status(s) for s in socks] == [401] * 8
        assert client.get("/v1/weights").status_code == 200
    finally:
        for s in socks:
            s.close()


def test_a_body_that_does_not_arrive_in_time_is_a_408(tmp_path: Path) -> None:
    # Its own service: a body deadline this short would spoil the other tests' bodies.
    config = ServiceConfig(db=str(tmp_path / "t.db"), token=TOKEN, body_timeout_s=0.5)
    with running_service(config) as url:
        sock = _send_headers(url, AUTH, 1 << 10)  # the headers promise a body never sent
        try:
            assert _status(sock) == 408
        finally:
            sock.close()


# -- engines ---------------------------------------------------------------------------------


def test_an_engine_serving_another_model_is_refused_at_registration(
        client: httpx.Client) -> None:
    # It was accepted (health only), then failed every turn with 404 and stayed.
    engine = EmulatedEngine(CostModel.named("qwen3-14b", "h100"), time_scale=0.02)
    with serve_in_thread(engine, "served") as srv:
        r = client.post("/v1/engines", json={"url": srv.url, "kind": "emulated",
                                             "model": "other"})
        loc, msg = _field_error(r)
        assert loc == ("body", "model") and "served" in msg
        ok = client.post("/v1/engines", json={"url": srv.url, "kind": "emulated",
                                              "model": "served"})
        assert ok.status_code == 201, ok.text
        assert client.delete(f"/v1/engines/{ok.json()['engine_id']}").status_code == 204


def test_serve_refuses_a_time_scale_for_real_engines(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    # It was silently ignored: the scheduler ran on real seconds.
    assert main(["serve", "--engine", "http://127.0.0.1:9", "--time-scale", "0.5",
                 "--db", ":memory:"]) == 2
    assert "time_scale" in capsys.readouterr().err


def test_serve_refuses_an_engine_url_that_is_not_one_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--engine", "--frozen-engine"):
        assert main(["serve", flag, "gpu-node:8000", "--db", ":memory:"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"treadle serve: {flag} gpu-node:8000: ") and err.count("\n") == 1


# -- restarts ----------------------------------------------------------------------------------


def test_the_service_announces_its_restart_time_and_the_client_waits_that_long(
        client: httpx.Client) -> None:
    r = client.get("/healthz")
    assert float(r.headers[RESTART_HEADER]) == r.json()["restart_s"] > 0
    assert limits.RESTART_HEADER == RESTART_HEADER
    watch = RestartWatch()
    watch.note(r)
    assert watch.seconds == r.json()["restart_s"]
    # The default policy waits five minutes; a restart announced as longer (here
    # 400 s) is waited out.
    retries = Retries(RetryPolicy(), "GET /x", watch)
    watch.seconds = 0.0  # a stream opened before the service's first answer...
    waits = [retries.failed(OSError("refused"))]
    watch.seconds = 400.0  # ...learns the restart time from that answer
    with pytest.raises(Exception, match="gave up"):
        while True:
            waits.append(retries.failed(OSError("refused")))
    assert 400.0 <= sum(waits) < 400.0 + RetryPolicy().max_backoff_s
    # A policy that does not wait gives up after its attempts, and long runs of
    # failures never overflow the back-off.
    no_wait = Retries(RetryPolicy(attempts=3, backoff_s=0.0, max_backoff_s=0.0), "x", watch)
    with pytest.raises(Exception, match="gave up after 3"):
        for _ in range(4):
            no_wait.failed(OSError("refused"))
    assert RetryPolicy(max_backoff_s=5.0).delay(5000) == 5.0

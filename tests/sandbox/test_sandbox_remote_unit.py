"""The remote backend's parts without HTTP: the server's SandboxHost (on a fake clock),
the wire models, and the client's argument checks."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from sandbox_helpers import SMALL, marker, run, sleepers, workdirs

from treadle.errors import (
    SandboxClosed,
    SandboxPathError,
    SandboxStartError,
    SandboxSupervisorError,
    SandboxUnavailable,
)
from treadle.sandbox import ExecResult, Limits, LocalBackend, get_backend
from treadle.sandbox.registry import backend_names
from treadle.sandbox.remote import RemoteBackend
from treadle.sandbox.server import SandboxHost, UnknownSandbox, create_app
from treadle.sandbox.wire import ExecReply, ExecRequest, LimitsModel, wire_error
from treadle.testing import FakeClock

IDS = [f"sandbox-{i:012d}" for i in range(4)]


def test_idle_sandboxes_are_reaped_busy_and_touched_ones_are_not(local: LocalBackend,
                                                                  work_root: str) -> None:
    clock = FakeClock(start=1000.0)

    async def body() -> None:
        host = SandboxHost(local, max_live=4, idle_ttl_s=10, clock=clock)
        for sandbox_id in IDS[:3]:
            await host.create(sandbox_id, SMALL)
        clock.advance(8)
        async with host.use(IDS[1]):  # a keepalive
            pass
        async with host.use(IDS[2]):  # a request in flight across the deadline
            clock.advance(5)
            assert await host.reap_idle() == 1  # only the untouched one
            assert host.ids() == IDS[1:3]
        clock.advance(9.9)  # the touch was 14.9 s ago, the request ended 9.9 s ago
        assert await host.reap_idle() == 1
        assert host.ids() == [IDS[2]]
        clock.advance(0.2)
        assert await host.reap_idle() == 1
        assert host.ids() == [] and host.live == 0
        with pytest.raises(UnknownSandbox):
            async with host.use(IDS[0]):
                pass

    run(body())
    assert not workdirs(work_root)


def test_the_host_caps_sandboxes_and_refuses_reused_ids(local: LocalBackend) -> None:
    async def body() -> None:
        host = SandboxHost(local, max_live=2, idle_ttl_s=0)
        await host.create(IDS[0], SMALL)
        with pytest.raises(ValueError, match="in use"):
            await host.create(IDS[0], SMALL)
        await host.create(IDS[1], SMALL)
        with pytest.raises(SandboxStartError, match="full"):
            await host.create(IDS[2], SMALL)
        await host.destroy(IDS[0])
        await host.destroy(IDS[0])  # idempotent
        await host.create(IDS[2], SMALL)  # the slot is free again
        assert await host.reap_idle() == 0  # TTL 0: never reaped
        await host.close()
        assert host.ids() == []
        with pytest.raises(SandboxStartError, match="shutting down"):
            await host.create(IDS[3], SMALL)

    run(body())


def test_close_and_interrupt_stop_running_execs(local: LocalBackend) -> None:
    tag = marker()

    async def body() -> None:
        host = SandboxHost(local, idle_ttl_s=0)
        await host.create(IDS[0], SMALL)
        await host.interrupt(IDS[0], "unknown-exec-id-0")  # no such exec: a no-op
        running = asyncio.ensure_future(host.exec(IDS[0], "exec-id-00000001", ["sleep", tag],
                                                  timeout_s=30, stdin=None, env={}))
        while not sleepers(tag):
            await asyncio.sleep(0.02)
        await host.interrupt(IDS[0], "exec-id-00000001")
        assert sleepers(tag) == []  # the interrupt waited for the tree
        with pytest.raises(SandboxClosed, match="interrupted"):
            await running
        again = asyncio.ensure_future(host.exec(IDS[0], "exec-id-00000002", ["sleep", tag],
                                                timeout_s=30, stdin=None, env={}))
        while not sleepers(tag):
            await asyncio.sleep(0.02)
        await host.close()
        assert sleepers(tag) == []
        with pytest.raises(SandboxClosed):
            await again

    run(body())


def test_wire_models_round_trip_and_are_strict() -> None:
    limits = Limits(cpu_s=3, memory_mb=100, address_space_mb=0, wall_timeout_s=2.5)
    assert LimitsModel.from_limits(limits).to_limits() == limits
    result = ExecResult(exit_code=None, stdout="a\udcff"[:1], stderr="e", timed_out=True,
                        killed="timeout", duration_s=1.5, truncated=False)
    wire = ExecReply.from_result(result).model_dump_json()
    assert ExecReply.model_validate_json(wire).to_result() == result
    good = {"exec_id": "x" * 16, "argv": ["true"], "timeout_s": 1}
    assert ExecRequest.model_validate(good).env == {}
    for bad in ({**good, "argv": []}, {**good, "argv": "true"}, {**good, "timeout_s": 0},
                {**good, "timeout_s": "1"}, {**good, "exec_id": "../../x"},
                {**good, "extra": 1}, {**good, "env": {"A": 1}}):
        with pytest.raises(ValidationError):
            ExecRequest.model_validate_json(__import__("json").dumps(bad))
    with pytest.raises(ValueError):
        LimitsModel.from_limits(limits).model_copy(update={"cpu_s": 0}).to_limits()


def test_error_names_stay_within_the_allow_list() -> None:
    assert wire_error(SandboxPathError("x")) == ("SandboxPathError", 400)
    assert wire_error(UnknownSandbox("x")) == ("SandboxClosed", 409)  # the server says 404
    assert wire_error(ValueError("x")) == ("ValueError", 400)
    assert wire_error(SandboxSupervisorError("x")) == ("SandboxSupervisorError", 502)
    assert wire_error(KeyError("x")) == ("InternalError", 500)


def test_backend_and_app_arguments_are_checked() -> None:
    for servers, token in ((["ftp://x"], "t"), (["http://a", "http://a/"], "t"),
                           (["http://a"], "")):
        with pytest.raises(ValueError):
            RemoteBackend(servers, token)
    assert RemoteBackend([], "t").outstanding() == {}  # a fleet adds its servers later
    assert RemoteBackend("http://a:1/", "t").outstanding() == {"http://a:1": 0}
    assert "remote" in backend_names()
    backend = get_backend("remote", servers=["http://a:1"], token="t")
    assert isinstance(backend, RemoteBackend) and backend.name == "remote"
    with pytest.raises(ValueError, match="16"):
        create_app(SandboxHost(LocalBackend()), "short")


def test_remote_without_its_extra_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_extra(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("treadle.sandbox.registry.importlib.import_module", no_extra)
    with pytest.raises(SandboxUnavailable, match=r"treadle\[server\]"):
        get_backend("remote", servers=["http://a:1"], token="t")


def test_a_copy_of_a_backend_follows_the_servers_its_original_accepts() -> None:
    fleet = RemoteBackend(["http://a:1", "http://b:1"], "token")
    copy = RemoteBackend(["http://a:1"], "token")
    copy._servers[0].outstanding = 1  # (a sandbox of the copy's open on a)
    fleet.add_server("http://c:1")
    fleet.retire_server("http://a:1")
    copy.follow(fleet.accepting())
    assert fleet.accepting() == copy.accepting() == ("http://b:1", "http://c:1")
    assert copy.outstanding() == {"http://a:1": 1, "http://b:1": 0, "http://c:1": 0}
    copy._servers[0].outstanding = 0  # a's last sandbox closed: a is forgotten
    copy.follow(fleet.accepting())
    assert list(copy.outstanding()) == ["http://b:1", "http://c:1"]
    copy.retire_server("http://c:1")  # retired here; the fleet takes it again
    copy.follow(fleet.accepting())
    assert copy.accepting() == ("http://b:1", "http://c:1")

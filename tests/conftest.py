"""Fixtures shared across the test folders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_server import vllm_server

__all__ = ["trained_checkpoint", "vllm_server"]


def _build_checkpoint(log: Callable[[str], None] | None = None) -> Path:
    from treadle.demo import DEMO_SFT_STEPS
    from treadle.train.cli import DEFAULT_CACHE
    from treadle.train.sft import SFTConfig, sft

    def say(message: str) -> None:
        if log is not None:
            log(f"treadle: {message}")

    return sft(SFTConfig(steps=DEMO_SFT_STEPS), DEFAULT_CACHE, log=say)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--chaos-long", action="store_true", default=False,
                     help="also run the long chaos runs (tests/chaos; many minutes)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the small model before any test runs when a selected test needs it: on a
    fresh machine that takes minutes (2 cores), which must not count against the
    first such test's timeout. Later runs find it in the cache at once."""
    if session.config.option.collectonly:
        return
    if any("trained_checkpoint" in getattr(item, "fixturenames", ())
           for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        write = reporter.write_line if reporter is not None else print
        _build_checkpoint(write)


# How the suite is shared among pytest-xdist workers (`scripts/test`: --dist
# loadgroup): a test module runs on one worker (its module fixtures are made once,
# and its tests may build on one another), and every test using a session fixture
# that starts a real engine runs on one worker, which starts that engine once.
_SHARED_ENGINES = ("vllm_server", "served")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        uses_engine = any(name in getattr(item, "fixturenames", ()) for name in _SHARED_ENGINES)
        item.add_marker(pytest.mark.xdist_group(
            "real-vllm" if uses_engine else item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def trained_checkpoint() -> Path:
    """The demo's checkpoint: good enough that its rollouts call the python tool and
    get some answers right (15% held-out success at T=1.0), so RL steps see groups
    with mixed rewards. Built once, before the tests (`pytest_collection_finish`;
    about 5 minutes on 2 cores), in the content-keyed cache the demo and `treadle
    train` use; later runs, and the demo, find it there."""
    return _build_checkpoint()

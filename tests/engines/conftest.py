"""Fixtures: the fake engine servers, each on a free loopback port for one test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engines_fakes import FakeSGLangServer, FakeVLLMServer


@pytest.fixture
def fake_vllm() -> Iterator[tuple[FakeVLLMServer, str]]:
    fake = FakeVLLMServer()
    with fake.serve() as url:
        yield fake, url


@pytest.fixture
def fake_sglang() -> Iterator[tuple[FakeSGLangServer, str]]:
    fake = FakeSGLangServer()
    with fake.serve() as url:
        yield fake, url

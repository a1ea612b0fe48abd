"""The gateway tests' fixtures: `served`, one real vLLM and service for the session
(every test module on real vLLM shares it; see `gateway_real`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.gateway_real import Served, serving


@pytest.fixture(scope="session")
def served(trained_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[Served]:
    """The service in this process in front of a real vLLM (the CPU build) serving
    the small trained model; `Served.engine` records every call made to vLLM."""
    with serving(trained_checkpoint, tmp_path_factory.mktemp("gateway-vllm")) as served:
        yield served

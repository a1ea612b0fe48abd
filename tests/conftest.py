"""Fixtures shared across the test folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_server import vllm_server

__all__ = ["trained_checkpoint", "vllm_server"]


@pytest.fixture(scope="session")
def trained_checkpoint() -> Path:
    """The demo's checkpoint: good enough that its rollouts call the python tool and
    get some answers right (15% held-out success at T=1.0), so RL steps see groups
    with mixed rewards. Built once (about 4 minutes on 2 cores) in the content-keyed
    cache the demo and `treadle train` use; later runs, and the demo, find it there."""
    from treadle.demo import DEMO_SFT_STEPS
    from treadle.train.cli import DEFAULT_CACHE
    from treadle.train.sft import SFTConfig, sft

    return sft(SFTConfig(steps=DEMO_SFT_STEPS), DEFAULT_CACHE, log=lambda _m: None)

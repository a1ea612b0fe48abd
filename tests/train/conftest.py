"""Fixtures of the train tests: real transcripts and a tiny checkpoint, once a session."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import record, tiny_checkpoint

from treadle.train.transcripts import Transcript


@pytest.fixture(scope="session")
def transcripts() -> list[Transcript]:
    return record(24)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, transcripts: list[Transcript]) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", transcripts)

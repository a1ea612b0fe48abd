"""The trainers' own virtualenvs, for the adapters' integration tests: each trainer
(trl, verl, skyrl) pins what the others conflict with, so each test runs its
trainer-side code in ``.venv-<name>`` (scripts/trainer-venv.sh) as a subprocess."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINER_VENV = REPO / "scripts" / "trainer-venv.sh"


@functools.cache
def trainer_python(name: str) -> Path:
    """The python of ``.venv-<name>``, with treadle (editable) and the trainer at the
    version its adapter is tested against. The script installs it on first use (a few
    minutes, once per machine: it keeps a stamp per pinned version) and is run once
    per test session; a failed install fails the test with the script's output."""
    done = subprocess.run(["bash", str(TRAINER_VENV), name], cwd=REPO, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/trainer-venv.sh {name} failed ({done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    python = Path(done.stdout.strip().splitlines()[-1])
    if not python.is_file():
        raise RuntimeError(f"scripts/trainer-venv.sh {name} printed {python}, which is no "
                           f"file")
    return python

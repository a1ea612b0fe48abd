"""`treadle demo`, the README's main job, end to end as a newcomer runs it: from a
checkout under /tmp with its own virtualenv there (the model already built:
`trained_checkpoint` is the demo's own, in the same cache).

Under /tmp because that is where a fresh clone often lands, and where a sandbox's
own /tmp could hide the interpreter; a demo whose tool calls all fail for such a
reason of the machine still "runs", so the test reads every tool output of both
jobs, not only whether they ended.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from treadle.store.export import read_parquet
from treadle.types import Trajectory
from vllm_server import ensure_vllm

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
# What a tool's output says when the machine failed the call rather than the model's
# code: bwrap's own errors (a sandbox that could not be built, an interpreter it could
# not find), treadle's executors' (a command they cannot run), prlimit's (the per-call
# gate) and the example harness's when it has no sandbox at all.
MACHINE_FAILURES = ("bwrap:", "treadle-sandbox:", "prlimit:", "error: no sandbox")


@pytest.fixture(scope="module")
def checkout_under_tmp() -> Iterator[Path]:
    """This checkout's files as a clone would have them (tracked and new, not ignored:
    no build output, no virtualenv), copied under /tmp, with a virtualenv of its own at
    .venv whose interpreter imports the copy's treadle and this environment's
    libraries (a .pth file: nothing is installed)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True,
                            check=True, timeout=60).stdout.decode().split("\0")
    top = Path(tempfile.mkdtemp(prefix="treadle-test-clone-", dir="/tmp"))
    try:
        clone = top / "treadle"
        for name in filter(None, listed):
            source = REPO / name
            if source.is_file():  # not one deleted since its last commit
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, clone / name)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(clone / ".venv")],
                       check=True, timeout=60)
        site = clone / ".venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        libraries = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
        (site / "site-packages" / "treadle-test.pth").write_text(
            f"{clone / 'src'}\n" + "".join(f"import site; site.addsitedir({p!r})\n"
                                           for p in libraries))
        yield clone
    finally:
        shutil.rmtree(top, ignore_errors=True)


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH: the copy's interpreter finds its own treadle."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_example_harness_runs_python_from_a_virtualenv_under_tmp(
        checkout_under_tmp: Path) -> None:
    python = checkout_under_tmp / ".venv" / "bin" / "python"
    code = ("import sys, treadle; from treadle.examples.math_harness import run_python; "
            "print(sys.prefix, treadle.__file__); print(run_python('print(6 * 7)'))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          timeout=60, env=clean_env(), cwd=checkout_under_tmp)
    assert done.returncode == 0, done.stderr
    where, output = done.stdout.split("\n", 1)
    assert where.split() == [str(checkout_under_tmp / ".venv"),
                             str(checkout_under_tmp / "src" / "treadle" / "__init__.py")]
    assert output == "42\n", done.stdout  # not "bwrap: execvp ...: No such file"


def tool_outputs(trajectory: Trajectory, decode: Callable[[list[int]], str]) -> list[str]:
    """The text of every run of tokens the model did not sample (tool outputs, with the
    chat format's markup) in the trajectory's token-exact record."""
    outputs: list[str] = []
    for segment in trajectory.segments:
        run: list[int] = []
        for token, sampled in [*zip(segment.response_ids, segment.loss_mask, strict=True),
                               (-1, 1)]:
            if not sampled:
                run.append(token)
            elif run:
                outputs.append(decode(run))
                run = []
    return outputs


@pytest.mark.slow
def test_the_demo_runs_both_jobs_through_the_service(trained_checkpoint: Path,
                                                     checkout_under_tmp: Path) -> None:
    from tokenizers import Tokenizer

    out = checkout_under_tmp / "out"
    done = subprocess.run(
        [str(checkout_under_tmp / ".venv" / "bin" / "python"), "-m", "treadle", "demo",
         "--cache", str(trained_checkpoint.parent), "--out", str(out),
         "--vllm-python", str(ensure_vllm())],
        capture_output=True, text=True, timeout=600, env=clean_env(), cwd=checkout_under_tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fine-tuning steps" not in done.stderr  # the cached model was used
    assert "tools in bwrap sandboxes" in done.stderr  # not the local backend's fallback
    # One summary table per job (the agent loop's, then the harness's), each ending in
    # its "all" row, then the two side by side.
    assert done.stdout.count("\nall ") == 2, done.stdout
    assert "treadle's agent loop" in done.stdout and "a harness through the gateway" \
        in done.stdout
    decode = Tokenizer.from_file(str(trained_checkpoint / "tokenizer.json")).decode
    parquets = sorted(out.glob("*.parquet"))
    assert len(parquets) == 2 and len(list(out.glob("*.html"))) == 2
    for parquet in parquets:
        trajectories = [t for _, t in read_parquet(parquet)]
        assert len(trajectories) == 32
        # Every trajectory of both doors ran: no harness crash, no infrastructure failure.
        assert all(not t.infra_failure and t.turns and t.segments for t in trajectories), \
            [(t.status, t.reason) for t in trajectories if t.infra_failure]
        # No tool call failed for a reason of the machine, and programs ran: some
        # output is a number a program printed, not an error.
        outputs = [text for t in trajectories for text in tool_outputs(t, decode)]
        failed = [text for text in outputs if any(f in text for f in MACHINE_FAILURES)]
        assert not failed, f"{parquet.name}: {len(failed)} tool calls failed: {failed[:3]}"
        assert any(any(c.isdigit() for c in text) and "Traceback" not in text
                   and "error" not in text.lower() for text in outputs), outputs[:5]
    assert (out / "demo.db").is_file()
    assert "demo: done in" in done.stderr


def test_the_demo_refuses_a_missing_vllm_interpreter(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "treadle", "demo", "--out", str(tmp_path),
         "--vllm-python", str(tmp_path / "nope" / "python")],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no such interpreter" in done.stderr

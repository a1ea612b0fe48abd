"""`treadle serve`: the rollout service on HTTP.

    treadle serve --port 8700 --token $TOKEN --db treadle.db \\
        --engine http://gpu-node-1:8000 --engine http://gpu-node-2:8000 \\
        --served-model Qwen/Qwen3-8B --tokenizer /models/qwen3-8b --sandbox bwrap

Engines: `--engine URL` (repeatable; `--engine-kind`, `--served-model` apply to
all), `--vllm MODEL_DIR` (vLLM engines started here, RL endpoints on), `--emulate N`
(emulated engine processes laid out by the policy on N GPUs,
for experiments without GPUs), or later `POST /v1/engines`. `--ray [ADDRESS]` starts
the engines of `--emulate` or `--vllm` on a Ray cluster (`--ray-resource NAME=AMOUNT`:
what each engine GPU asks of a node besides the GPU), or runs beside `--engine`s;
with `--runners N`, workload replays, suite tasks and gateway sessions' turns run in
N runner actors there (`runtime.ray_runners`). Frozen sub-agents'
sessions go to `--frozen-engine URL` (repeatable: engines at a pinned version that
weight updates never reach, `--frozen-served-model`, `--frozen-policy-version`) when
given. Suite tasks need
`--tokenizer`. Exits 2 with one line on stderr for bad input.

Keys (docs/security.md): `--token` is the admin's; `--keys FILE` adds trainer keys,
one per line as `treadle keys new RUN --file FILE` writes them (the key printed
once, the file keeping its SHA-256 only).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import pydantic

from treadle.agent.chat import DEFAULT_FORMAT, FORMATS

if TYPE_CHECKING:
    from treadle.core.policies.progressive import Staleness
    from treadle.runtime.ray_launcher import RayCluster
    from treadle.runtime.ray_runners import RunnerActors
    from treadle.runtime.ray_sandboxes import SandboxServers
    from treadle.sandbox.autoscale import Scaling
    from treadle.service.schemas import EngineRequest


def _engines(flag: str, urls: list[str], kind: str, model: str) -> list[EngineRequest]:
    """The engines `flag` names; ValueError in one line for a URL that is not one."""
    from treadle.service.schemas import EngineRequest

    pool = "frozen" if flag == "--frozen-engine" else "policy"
    out = []
    for url in urls:
        try:
            out.append(EngineRequest.model_validate(
                {"url": url, "kind": kind, "model": model, "pool": pool}))
        except pydantic.ValidationError as e:
            raise ValueError(f"{flag} {url}: {e.errors()[0]['msg']}") from None
    return out


def add_serve_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `serve` on the main CLI's subparsers; handler in `args.func`."""
    p = subparsers.add_parser("serve", help="the rollout service on HTTP")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--token", default=os.environ.get("TREADLE_TOKEN"),
                   help="bearer token every route but /healthz requires (default "
                        "$TREADLE_TOKEN; none: no auth, loopback only)")
    p.add_argument("--keys", default=None, metavar="FILE",
                   help="trainer keys: lines 'TRAINER_RUN sha256:HEX' (treadle keys new "
                        "writes them); each key sees its own run's jobs, sessions and "
                        "weights only (docs/security.md). Needs --token")
    p.add_argument("--db", default="treadle.db", help="SQLite file of jobs and results")
    p.add_argument("--store-process", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the store (SQLite, record encoding) in a process of its own, "
                        "off the scheduler's cores; on by default with --runners and a "
                        "--db file")
    p.add_argument("--engine", action="append", default=[], metavar="URL",
                   help="an inference engine already running (repeatable)")
    p.add_argument("--engine-kind", choices=("vllm", "sglang", "emulated"), default="vllm")
    p.add_argument("--served-model", default="model",
                   help="the engines' served model name (vLLM --served-model-name)")
    p.add_argument("--frozen-engine", action="append", default=[], metavar="URL",
                   help="an engine of the frozen pool, serving frozen sub-agents' sessions "
                        "at a pinned version (repeatable; same --engine-kind)")
    p.add_argument("--frozen-served-model", default=None,
                   help="the frozen engines' served model name (default --served-model)")
    p.add_argument("--frozen-policy-version", type=int, default=0,
                   help="the version the frozen engines serve, stamped on their tokens")
    p.add_argument("--emulate", type=int, default=0, metavar="GPUS",
                   help="start emulated engines on this many (modelled) GPUs")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="of the emulated engines and the scheduler's clock (0.1 = 10x "
                        "faster than modelled; job timings are then in modelled seconds); "
                        "with --emulate only")
    p.add_argument("--vllm", default=None, metavar="MODEL_DIR",
                   help="start vLLM engines serving this model directory (with the RL "
                        "endpoints, so weight updates work); its tokenizer is the default "
                        "--tokenizer")
    p.add_argument("--vllm-engines", type=int, default=1, help="how many vLLM engines")
    p.add_argument("--vllm-python", default=os.environ.get("TREADLE_VLLM_PYTHON",
                                                           ".venv-vllm/bin/python"),
                   help="the interpreter vLLM is installed in (scripts/vllm-cpu.sh "
                        "installs one at .venv-vllm)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="--max-model-len of the vLLM engines started here")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="start the engines of --emulate or --vllm on a Ray cluster (the ray "
                        "extra): the one at ADDRESS, or without one $RAY_ADDRESS's, or a "
                        "local one started here; the policy plans the pool for its GPUs "
                        "(with --engine: the engines are those, the cluster runs the "
                        "runners and sandbox servers)")
    p.add_argument("--ray-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="what each engine GPU asks of a Ray node besides the GPU (a custom "
                        "resource the engine nodes declare); repeatable")
    p.add_argument("--sandbox-servers", default=None, metavar="MIN:MAX",
                   help="with --ray: run tools on treadle sandbox-server actors on the "
                        "cluster (their backend: --sandbox), from MIN to MAX of them as "
                        "the sandbox pools' demand asks")
    p.add_argument("--sandbox-server-resource", action="append", default=[],
                   metavar="NAME=AMOUNT",
                   help="what each sandbox server asks of a Ray node besides a CPU (a "
                        "custom resource the sandbox nodes declare); repeatable")
    p.add_argument("--sandbox-server-images", default=None, metavar="DIR",
                   help="with --sandbox-servers and --sandbox bwrap: each server runs "
                        "sandboxes on the environment images under DIR (the same path on "
                        "every sandbox node), so suites of image tasks run on the cluster")
    p.add_argument("--runners", type=int, default=None, metavar="N",
                   help="with --ray: run workload replays and suite tasks (their agent "
                        "loops, engine calls, sandboxes, tools and rewards), and gateway "
                        "sessions' turns, in N runner actors on the cluster, the scheduler "
                        "staying here")
    p.add_argument("--runner-cpus", type=float, default=1.0,
                   help="Ray CPUs each runner actor holds")
    p.add_argument("--runner-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="what each runner actor asks of a Ray node besides its CPUs (a "
                        "custom resource the runner nodes declare); repeatable")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the served model's tokenizer.json directory (needed for suite tasks)")
    p.add_argument("--chat-format", default=DEFAULT_FORMAT, choices=sorted(FORMATS),
                   help="the served model's chat format: how suite jobs and gateway "
                        "sessions render conversations unless they name one")
    p.add_argument("--sandbox", default="bwrap", choices=("bwrap", "local", "remote", "none"),
                   help="where tools run (local isolates nothing; development only)")
    p.add_argument("--sandbox-max-live", type=int, default=64,
                   help="sandboxes at once, per suite")
    p.add_argument("--sandbox-rate", type=float, default=64.0,
                   help="sandbox starts a second, per suite (a guard against start storms)")
    p.add_argument("--policy", default="treadle", help="scheduling policy")
    p.add_argument("--model", default="qwen3-14b", help="cost-model entry the policy plans with")
    p.add_argument("--gpu", default="h100", help="cost-model entry")
    p.add_argument("--max-live", type=int, default=4096, help="trajectories running at once")
    p.add_argument("--staleness", type=int, default=None, metavar="VERSIONS",
                   help="asynchronous RL: the treadle policy runs older trajectories first "
                        "across weight updates, for a bound of VERSIONS (docs/async.md)")
    p.add_argument("--staleness-gate", action="store_true",
                   help="with --staleness: start no trajectory that would go stale before "
                        "it could finish")
    p.add_argument("--reconfigure", action="store_true",
                   help="the treadle policy merges idle engines into one of a larger TP "
                        "degree for a job's long tail (needs --emulate or --vllm; "
                        "docs/runtime.md)")
    p.add_argument("--resume-from", choices=("turn", "prompt"), default="turn",
                   help="where a trajectory a restart interrupted starts again: its last "
                        "journaled turn (default), or its prompt (to measure the difference)")
    p.add_argument("--data-root", action="append", default=[], metavar="DIR",
                   help="a directory whose files jobs may name in suite options such as "
                        "nemo_gym's rows_path (repeatable; default none: no file may be "
                        "named)")
    p.add_argument("--harness", action="append", default=[], metavar="NAME=CMD",
                   help="an agent harness jobs may name (repeatable): CMD runs once per "
                        "trajectory with OPENAI_BASE_URL set to its session (docs/gateway.md)")
    p.add_argument("--harness-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="a harness run's wall-clock limit")
    p.add_argument("--public-url", default=None,
                   help="this service's URL as harnesses reach it (default: for harness "
                        "jobs http://HOST:PORT; for sessions the URL each one was made at)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run_serve)


def add_keys_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `keys` on the main CLI's subparsers; handler in `args.func`."""
    p = subparsers.add_parser("keys", help="trainer keys for treadle serve --keys")
    sub = p.add_subparsers(dest="keys", required=True)
    new = sub.add_parser("new", help="a new trainer key: its line is appended to FILE, the "
                                     "key printed (once: FILE keeps its SHA-256 only)")
    new.add_argument("trainer_run", help="the trainer run the key speaks for")
    new.add_argument("--file", required=True, help="the keys file (created if missing)")
    new.set_defaults(func=run_keys_new)


def run_keys_new(args: argparse.Namespace) -> int:
    """`treadle keys new RUN --file FILE`: the key on stdout, its line in FILE."""
    from treadle.service.keys import TRAINER_PREFIX, file_line, new_key

    key = new_key(TRAINER_PREFIX)
    try:
        line = file_line(args.trainer_run, key)
        with open(args.file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except (ValueError, OSError) as e:
        print(f"treadle keys: {e}", file=sys.stderr)
        return 2
    print(key)
    return 0


def harnesses(specs: list[str], timeout_s: float) -> dict[str, Any]:
    """`NAME=CMD` options as harnesses; ValueError naming a bad one."""
    from treadle.gateway.harness import Harness, parse_command

    out: dict[str, Any] = {}
    for spec in specs:
        name, _, command = spec.partition("=")
        if not name or not command or name in out:
            raise ValueError(f"--harness {spec!r}: NAME=CMD, each NAME once")
        out[name] = Harness(name, parse_command(command), timeout_s=timeout_s)
    return out


def _reachable(host: str) -> str:
    """An address a local harness reaches a service bound to `host` at (as a URL's host)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from treadle.service.app import create_app
    from treadle.service.keys import read_keys_file
    from treadle.service.state import ServiceConfig, build_service

    try:
        if not 0 < args.port < 65536:
            raise ValueError("--port must be in 1-65535")
        if args.time_scale <= 0 or args.emulate < 0 or args.max_live < 1:
            raise ValueError("--time-scale must be > 0, --emulate >= 0, --max-live >= 1")
        if args.sandbox_rate <= 0 or args.sandbox_max_live < 1:
            raise ValueError("--sandbox-rate must be > 0, --sandbox-max-live >= 1")
        pools = ServiceConfig().sandbox_pool
        pools = dataclasses.replace(pools, max_live=args.sandbox_max_live,
                                    create_rate_per_s=args.sandbox_rate,
                                    warm=min(pools.warm, args.sandbox_max_live))
        engines = _engines("--engine", args.engine, args.engine_kind, args.served_model)
        frozen = _engines("--frozen-engine", args.frozen_engine, args.engine_kind,
                          args.frozen_served_model or args.served_model)
        servers, scaling = _sandbox_servers(args)
        sandbox = (None if args.sandbox == "none" or servers is not None
                   else _sandbox(args.sandbox))
        if args.vllm and not os.path.exists(args.vllm_python):
            raise ValueError(f"--vllm-python {args.vllm_python}: no such interpreter "
                             "(bash scripts/vllm-cpu.sh installs vLLM at .venv-vllm)")
        ray = _ray_cluster(args)
        trainer_keys = tuple(read_keys_file(args.keys)) if args.keys else ()
        if trainer_keys and args.token is None:
            raise ValueError("--keys needs --token (or $TREADLE_TOKEN): without a token "
                             "every request is the admin's")
        config = ServiceConfig(db=args.db, token=args.token, trainer_keys=trainer_keys,
                               policy=args.policy,
                               model=args.model, gpu=args.gpu, engines=engines,
                               emulate=args.emulate, time_scale=args.time_scale,
                               tokenizer=args.tokenizer or args.vllm, sandbox=sandbox,
                               max_live=args.max_live, resume_from=args.resume_from,
                               staleness=_staleness(args), reconfigure=args.reconfigure,
                               vllm_model=args.vllm,
                               sandbox_pool=pools,
                               vllm_engines=args.vllm_engines,
                               vllm_python=os.path.abspath(args.vllm_python),
                               vllm_max_model_len=args.max_model_len,
                               data_roots=tuple(_data_roots(args.data_root)),
                               harnesses=harnesses(args.harness, args.harness_timeout),
                               public_url=args.public_url, frozen_engines=frozen,
                               chat_format=args.chat_format, ray=ray,
                               sandbox_servers=servers, sandbox_scaling=scaling,
                               runners=_runners(args),
                               store_process=(args.runners is not None
                                              and args.db != ":memory:"
                                              if args.store_process is None
                                              else args.store_process),
                               frozen_policy_version=args.frozen_policy_version)
        service = build_service(config)
        if service.gateway.url is None:  # where harness jobs' commands reach it
            service.gateway.url = f"http://{_reachable(args.host)}:{args.port}"
    except (ValueError, KeyError, OSError) as e:
        print(f"treadle serve: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.warning("serving on %s without --token: anyone who can reach it can run "
                        "jobs", args.host)
    # httptools parses HTTP/1.1 in C: a share of the service's CPU per gateway call
    # off the pure-Python h11 (benchmarks/gateway.json). Named, so that a missing one
    # is an error at start rather than a silent fall back to h11. Not uvloop, though
    # faster still: its subprocess_exec takes no user/group, which the sandboxes use.
    server = uvicorn.Server(uvicorn.Config(create_app(service), host=args.host, port=args.port,
                                           log_level=args.log_level, access_log=False,
                                           http="httptools",
                                           lifespan="on", timeout_graceful_shutdown=10))
    asyncio.run(server.serve())
    return 0


def _ray_cluster(args: argparse.Namespace) -> RayCluster | None:
    """`--ray [ADDRESS]` and `--ray-resource`s; ValueError in one line for bad input,
    Ray not installed included."""
    from treadle.runtime.ray_launcher import RayCluster, require_ray

    if args.ray is None:
        if args.ray_resource:
            raise ValueError("--ray-resource needs --ray")
        return None
    if not (args.emulate or args.vllm or args.engine):
        raise ValueError("--ray starts the engines of --emulate GPUS or --vllm MODEL_DIR, "
                         "or runs beside engines given by --engine URL: give one")
    resources = tuple(_resource("--ray-resource", r) for r in args.ray_resource)
    require_ray()
    return RayCluster(args.ray or None, resources=resources)


def _runners(args: argparse.Namespace) -> RunnerActors | None:
    """`--runners N`, `--runner-cpus` and `--runner-resource`s; ValueError in one line."""
    from treadle.runtime.ray_runners import RunnerActors

    if args.runners is None:
        if args.runner_resource:
            raise ValueError("--runner-resource needs --runners")
        return None
    if args.ray is None:
        raise ValueError("--runners starts runner actors on a Ray cluster: give --ray too")
    if args.runners < 1 or args.runner_cpus < 0:
        raise ValueError("--runners N: N >= 1 (and --runner-cpus >= 0)")
    resources = tuple(_resource("--runner-resource", r) for r in args.runner_resource)
    return RunnerActors(args.runners, num_cpus=args.runner_cpus, resources=resources)


def _sandbox_servers(args: argparse.Namespace) -> tuple[SandboxServers | None, Scaling]:
    """`--sandbox-servers MIN:MAX` and `--sandbox-server-resource`s: (SandboxServers
    or None, Scaling); ValueError in one line for bad input."""
    from treadle.runtime.ray_sandboxes import SandboxServers
    from treadle.sandbox.autoscale import Scaling

    if args.sandbox_servers is None:
        if args.sandbox_server_resource or args.sandbox_server_images:
            raise ValueError("--sandbox-server-resource and --sandbox-server-images need "
                             "--sandbox-servers")
        return None, Scaling()
    if args.ray is None:
        raise ValueError("--sandbox-servers starts sandbox servers on a Ray cluster: "
                         "give --ray too")
    if args.sandbox not in ("bwrap", "local"):
        raise ValueError("--sandbox-servers: the servers' --sandbox is bwrap or local")
    low, _, high = args.sandbox_servers.partition(":")
    try:
        scaling = Scaling(min_servers=int(low), max_servers=int(high))
    except ValueError as e:
        raise ValueError(f"--sandbox-servers {args.sandbox_servers!r}: MIN:MAX, "
                         "0 <= MIN <= MAX, MAX >= 1") from e
    resources = tuple(_resource("--sandbox-server-resource", r)
                      for r in args.sandbox_server_resource)
    if args.sandbox_server_images is not None and args.sandbox != "bwrap":
        raise ValueError("--sandbox-server-images: images run on bwrap servers (--sandbox "
                         "bwrap)")
    return SandboxServers(backend=args.sandbox, resources=resources,
                          images=args.sandbox_server_images), scaling


def _staleness(args: argparse.Namespace) -> Staleness | None:
    """`--staleness`, `--staleness-gate` (ValueError for a gate without a bound)."""
    from treadle.core.policies.progressive import Staleness

    if args.staleness is None:
        if args.staleness_gate:
            raise ValueError("--staleness-gate needs --staleness VERSIONS")
        return None
    if args.staleness < 1 or args.policy != "treadle":
        raise ValueError("--staleness: a number of versions >= 1, with --policy treadle")
    return Staleness(args.staleness, finish_first=True, gate=args.staleness_gate)


def _resource(flag: str, spec: str) -> tuple[str, float]:
    """A NAME=AMOUNT flag's value; ValueError in one line."""
    name, _, amount = spec.partition("=")
    try:
        value = float(amount)
    except ValueError:
        value = 0.0
    if not name or not value > 0:
        raise ValueError(f"{flag} {spec!r}: NAME=AMOUNT, AMOUNT > 0")
    return name, value


def _data_roots(paths: list[str]) -> list[str]:
    for path in paths:
        if not os.path.isdir(path):
            raise ValueError(f"--data-root {path}: not a directory")
    return [os.path.realpath(p) for p in paths]


def _sandbox(name: str) -> Any:
    from treadle.sandbox.registry import get_backend

    if name == "remote":
        raise ValueError("--sandbox remote needs servers and a token: register the service "
                         "through the Python API (treadle.service.state) instead")
    return get_backend(name)

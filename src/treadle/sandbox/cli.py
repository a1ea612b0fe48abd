"""`treadle sandbox exec`: run one command in a fresh sandbox and print a JSON result;
`treadle sandbox unpack`: unpack an environment image into the cache ahead of use.

    treadle sandbox exec --backend bwrap --timeout 5 --memory-mb 256 -- python3 -c 'print(1)'

Prints one JSON object on stdout: exit_code, stdout, stderr, timed_out, killed,
duration_s (and truncated). Exits 0 whenever the command ran, whatever it did (its
status is in the JSON); exits 2 with one line on stderr for bad input or a backend
that cannot run here (e.g. bwrap not installed).

    treadle sandbox exec --backend bwrap --image ./rootfs -- cat /etc/os-release
    treadle sandbox unpack task-image.tar    # pre-warm: unpack into the image cache now
    treadle sandbox exec --backend remote --server http://10.0.0.5:8790 -- true
    treadle sandbox-server --port 8790 --backend bwrap --max-live 64

The token of `--backend remote` and of `sandbox-server` is `--token` or, better
(command lines are visible to every local user), $TREADLE_SANDBOX_TOKEN.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from treadle.errors import SandboxError

TOKEN_ENV = "TREADLE_SANDBOX_TOKEN"


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `sandbox exec` on the main CLI's subparsers; handler in `args.func`."""
    sandbox = subparsers.add_parser("sandbox", help="run commands in sandboxes")
    commands = sandbox.add_subparsers(dest="sandbox_command", required=True)
    run = commands.add_parser("exec", help="run one command in a fresh sandbox, print JSON")
    # Values are checked in run_exec, not by argparse, so that bad input gives one
    # line on stderr rather than a usage dump.
    run.add_argument("--backend", default="bwrap", metavar="{bwrap,local,remote}",
                     help="bwrap isolates; local is for development and isolates nothing; "
                          "remote runs it on a sandbox server (--server, --token)")
    run.add_argument("--timeout", default="30", metavar="S",
                     help="wall-clock limit in seconds (default 30)")
    run.add_argument("--memory-mb", default="512", metavar="M",
                     help="memory limit in MiB (default 512)")
    run.add_argument("--server", action="append", default=[], metavar="URL",
                     help="a sandbox server for --backend remote (repeatable)")
    run.add_argument("--token", default=None,
                     help=f"the servers' token for --backend remote (default ${TOKEN_ENV})")
    run.add_argument("--image", default=None, metavar="REF",
                     help="run on this environment image (a root file system dir, an OCI "
                          "layout dir, an OCI/docker-save tar, or a SIF file) instead of the "
                          "host's system dirs: --backend bwrap, or remote on a server started with "
                          "--images (REF as the server's host names it)")
    run.add_argument("--image-cache", default=None, metavar="DIR",
                     help="where images are unpacked (default $TREADLE_CACHE/images, else "
                          "/var/cache/treadle/images as root, ~/.cache/treadle/images "
                          "otherwise)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                     help="the command and its arguments, after --")
    run.set_defaults(func=run_exec)
    unpack = commands.add_parser("unpack", help="unpack an environment image into the cache "
                                                "now (pre-warm a host), print JSON")
    unpack.add_argument("image", metavar="REF",
                        help="an OCI layout dir, an OCI/docker-save tar, a SIF file, or a "
                             "rootfs dir")
    unpack.add_argument("--image-cache", default=None, metavar="DIR",
                        help="the image cache (default as for `sandbox exec`)")
    unpack.set_defaults(func=run_unpack)


def run_exec(args: argparse.Namespace) -> int:
    """Handler of `sandbox exec`: 0 with the JSON result, 2 with an error line."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        return _fail("no command given; usage: treadle sandbox exec [options] -- CMD ...")
    try:
        timeout_s = float(args.timeout)
        memory_mb = int(args.memory_mb)
    except ValueError:
        return _fail("--timeout must be a number of seconds and --memory-mb an integer")
    if not timeout_s > 0 or memory_mb <= 0:
        return _fail("--timeout and --memory-mb must be positive")
    from treadle.sandbox.registry import backend_names, exec_once  # lazy: keep --help fast

    if args.backend not in backend_names():
        return _fail(f"unknown backend {args.backend!r}; choose one of "
                     f"{', '.join(backend_names())}")
    options: dict[str, Any] = {}
    if args.backend == "remote":
        token = args.token or os.environ.get(TOKEN_ENV, "")
        if not args.server or not token:
            return _fail(f"--backend remote needs --server URL and --token (or ${TOKEN_ENV})")
        options = {"servers": args.server, "token": token}
    if args.image is not None and args.backend not in ("bwrap", "remote"):
        return _fail("--image needs --backend bwrap, or remote on a server with --images")
    if args.image_cache is not None:
        if args.backend != "bwrap":
            return _fail("--image-cache needs --backend bwrap (a server has its own cache)")
        from treadle.sandbox.images import ImageCache

        options = {"image_cache": ImageCache(args.image_cache)}
    try:
        result = asyncio.run(exec_once(args.backend, argv, timeout_s, memory_mb,
                                       backend_options=options, image=args.image))
    except (SandboxError, ValueError, KeyError) as e:
        return _fail(str(e).strip("'\""))
    print(json.dumps({
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "timed_out": result.timed_out,
        "killed": result.killed,
        "duration_s": round(result.duration_s, 4),
        "truncated": result.truncated,
    }))
    return 0


def run_unpack(args: argparse.Namespace) -> int:
    """Handler of `sandbox unpack`: 0 with the image as JSON, 2 with an error line."""
    from treadle.sandbox.images import ImageCache, default_cache

    try:
        cache = ImageCache(args.image_cache) if args.image_cache else default_cache()
        image = cache.open(args.image)
    except (SandboxError, ValueError) as e:
        return _fail(str(e))
    print(json.dumps({
        "ref": image.ref, "kind": image.kind, "digest": image.digest, "rootfs": image.rootfs,
        "unpacked_s": None if image.unpacked_s is None else round(image.unpacked_s, 3),
        "env": dict(image.config.env), "working_dir": image.config.working_dir,
        "user": image.config.user,
    }))
    return 0


def add_server_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register `sandbox-server` on the main CLI's subparsers; handler in `args.func`."""
    serve = subparsers.add_parser("sandbox-server",
                                  help="host sandboxes for remote clients over HTTP")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1; there is no TLS: keep it "
                            "on a private network or behind a TLS proxy)")
    serve.add_argument("--port", type=int, default=8790, help="port (default 8790)")
    serve.add_argument("--token", default=None,
                       help=f"bearer token clients must send (default ${TOKEN_ENV}; "
                            "at least 16 characters)")
    serve.add_argument("--backend", default="bwrap", choices=["bwrap", "local"],
                       help="the local backend that runs the sandboxes")
    serve.add_argument("--max-live", type=int, default=64,
                       help="most sandboxes at once (default 64)")
    serve.add_argument("--idle-ttl", type=float, default=120.0, metavar="S",
                       help="close a sandbox after S seconds without a request; clients "
                            "send keepalives (default 120, 0 = never)")
    serve.add_argument("--max-request-mb", type=int, default=32, metavar="M",
                       help="largest request body, MiB (default 32)")
    serve.add_argument("--work-root", default=None,
                       help="host directory for work dirs (default <tmp>/treadle-sandboxes)")
    serve.add_argument("--images", default=None, metavar="DIR",
                       help="run sandboxes on the environment images under DIR that clients "
                            "name (root file system dirs, OCI layout dirs, OCI/docker-save "
                            "tars, SIF files); default: no images (bwrap backend only)")
    serve.set_defaults(func=run_server)


def run_server(args: argparse.Namespace) -> int:
    """Handler of `sandbox-server`: serves until SIGINT/SIGTERM, then 0; 2 for bad input."""
    token = args.token or os.environ.get(TOKEN_ENV, "")
    if len(token) < 16:
        return _fail(f"sandbox-server needs --token (or ${TOKEN_ENV}) of at least 16 "
                     "characters, e.g. from `python3 -c 'import secrets; "
                     "print(secrets.token_urlsafe(32))'`")
    if args.max_live < 1 or args.idle_ttl < 0 or args.max_request_mb < 1:
        return _fail("--max-live and --max-request-mb must be >= 1, --idle-ttl >= 0")
    if args.images is not None and (args.backend != "bwrap" or not os.path.isdir(args.images)):
        return _fail("--images needs --backend bwrap and an existing directory")
    try:
        from treadle.sandbox.server import SandboxHost, serve
    except ImportError as e:
        return _fail(f"sandbox-server needs the 'server' extra: pip install 'treadle[server]' "
                     f"({e})")
    from treadle.sandbox.registry import get_backend

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning(
            "serving on %s without TLS: the token and all traffic are readable on the "
            "network; keep it private or put a TLS proxy in front", args.host)
    host = SandboxHost(get_backend(args.backend, work_root=args.work_root),
                       max_live=args.max_live, idle_ttl_s=args.idle_ttl, images=args.images)
    try:
        asyncio.run(serve(host, token, bind=args.host, port=args.port,
                          max_body_bytes=args.max_request_mb * 1024 * 1024))
    except (SandboxError, OSError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once every sandbox is closed
        return 130
    return 0


def _fail(message: str) -> int:
    print(f"treadle sandbox: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (tests, `python -m treadle.sandbox.cli`): sandbox exec, sandbox-server."""
    parser = argparse.ArgumentParser(prog="treadle")
    commands = parser.add_subparsers(dest="command", required=True)
    add_parser(commands)
    add_server_parser(commands)
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse already printed a usage line
        return 2 if e.code else 0
    handler = args.func
    code: int = handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

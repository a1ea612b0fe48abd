"""Sandboxes for agent tools: run untrusted commands with limits, get a clean result.

One interface (`Sandbox`, `SandboxBackend`, `Limits`, `ExecResult` in `base`), three
backends, and a pool:

- `bwrap` (`BwrapBackend`): rootless bubblewrap. Own pid, network (loopback
  only), IPC, UTS, user and cgroup namespaces; a read-only view of the system
  directories and nothing else of the host; an unprivileged uid when treadle is
  root; a seccomp filter (no ptrace, no kernel keys, no calls a tool never needs);
  rlimits on the whole tree; cgroup (v1 or v2) memory/pids limits where writable; on
  request, a work dir of bounded size and file count where treadle may mount.
  This is the backend for running model-written code. With `image=`, sandboxes
  run on an environment image's root file system instead of the host's system
  dirs (`treadle.sandbox.images`: root file system dirs, OCI layouts, OCI and
  docker-save archives, unpacked once per host into a cache by digest).
- `local` (`LocalBackend`): the same limits, timeout, output cap and tree kill on
  plain child processes. It isolates nothing; development only.
- `remote` (`treadle.sandbox.remote.RemoteBackend`; needs the `server` extra, so
  it is imported on first use, not here): sandboxes hosted by `treadle
  sandbox-server` nodes (`treadle.sandbox.server`, bwrap behind them), reached
  over HTTP with a bearer token and spread over a pool of servers.
- `SandboxPool`: warm spares, a creation rate limit, a cap on live sandboxes and
  a cleanup that always runs.

What is and is not protected, and how to set limits: docs/sandbox.md. In one
line: the bwrap backend contains what a process can do through the file system,
the network, signals, other processes, kernel keys and resource use; it does not
defend against kernel exploits through the calls its filter allows, or side
channels, and caps a work dir's total size only when asked to and where treadle
may mount (root).
"""

from treadle.sandbox.base import ExecResult, Limits, Sandbox, SandboxBackend
from treadle.sandbox.bwrap import BwrapBackend
from treadle.sandbox.local import LocalBackend
from treadle.sandbox.pool import PoolSettings, PoolStats, SandboxPool, TokenBucket
from treadle.sandbox.registry import BACKENDS, exec_once, get_backend

__all__ = [
    "BACKENDS",
    "BwrapBackend",
    "ExecResult",
    "Limits",
    "LocalBackend",
    "PoolSettings",
    "PoolStats",
    "Sandbox",
    "SandboxBackend",
    "SandboxPool",
    "TokenBucket",
    "exec_once",
    "get_backend",
]

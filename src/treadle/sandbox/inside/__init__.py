"""The programs treadle runs inside a sandbox, not in its own process.

What runs where:

- In treadle's process (the host): everything of `treadle.sandbox` outside this
  package. It builds each sandbox (bwrap's namespaces and mounts, rlimits,
  cgroups), starts the programs below in it, talks to them and reads their results.
- Inside a bwrap sandbox, as its resident executor (see `treadle.sandbox._resident`):
  `agent` is pid 1 of the sandbox's namespaces and serves its calls, with `procs`
  (how it spawns calls and reads processes) and `scratch` (its clean-up of /tmp,
  /dev/shm and IPC between calls); `zygote` is the idle interpreter the agent
  forks `python3 -u -` calls and Python-session cells from. treadle's checkout is
  hidden in there, so none of them imports treadle: the host passes their sources
  on the command line and `boot` (the `-c` program) loads them.
- Around each command of the local backend (`treadle.sandbox.local`): `reaper`, the
  supervisor that sets the rlimits and kills whatever the command leaves, run as a
  script by its path.

Standard library only, each of them, and nothing of the host passes in but its
command line, its environment and the descriptors the host hands it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def source(name: str) -> str:
    """The source of this package's module `name`, as the host passes it in."""
    return (Path(__file__).parent / f"{name}.py").read_text()

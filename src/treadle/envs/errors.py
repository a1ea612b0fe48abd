"""The envs branch of treadle's exception tree (see `treadle.errors`).

    TreadleError
    └── EnvError                     anything treadle.envs raises on purpose
        ├── TaskFormatError          a task record (JSONL line, dict) is malformed
        │                            (also a ValueError); the message names the field
        │                            and, for files, the path and line
        ├── EnvConfigError           the environment is set up wrongly by its caller:
        │                            a code-running tool without a sandbox, an unknown
        │                            suite, a suite option out of range
        └── ResourcesServerError     an external environment (a NeMo Gym resources
                                     server) cannot be reached or cannot score

What the model does wrong is never one of these: bad tool arguments, a failing
command, a missing file or a wrong answer come back as a `ToolResult` with `error`
set, or as a low reward. These exceptions mean the environment itself failed, which
a trainer must tell apart from the agent failing (no reward is invented for it).
"""

from __future__ import annotations

from treadle.errors import TreadleError


class EnvError(TreadleError):
    """Root of the envs package's exceptions."""


class TaskFormatError(EnvError, ValueError):
    """A task record is malformed; the message says which field and why."""


class EnvConfigError(EnvError):
    """The environment was configured or called wrongly (a caller bug, not the model's)."""


class ResourcesServerError(EnvError):
    """An external resources server failed: unreachable, timed out, or could not verify."""

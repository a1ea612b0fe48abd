"""The exceptions treadle raises, as one tree.

Catch `TreadleError` to catch everything treadle raises on purpose; anything else
escaping treadle is a bug. Each package owns a branch::

    TreadleError
    ├── InputError                      bad input from a caller; its message names the
    │   │                               field (also a ValueError)
    │   ├── UsageError                  a command line the CLI refuses (printed as one
    │   │                               line, exit code 2)
    │   ├── TraceError                  treadle.workloads.trace: a trace line that breaks
    │   │                               the format (names file, line and field)
    │   ├── RequestRefused              treadle.service.errors: a job the service cannot
    │   │                               run (unknown suite, no tokenizer, a trace line
    │   │                               past the model's window, a file outside the
    │   │                               allowed roots; the API's 422)
    │   └── InvalidRequest              treadle.gateway.errors: a chat completion the
    │                                   gateway cannot honour as written (names the
    │                                   parameter; also a GatewayError)
    ├── GatewayError                    treadle.gateway.errors: a call answered with an
    │   ├── UnknownSession              OpenAI-shaped error: no such session (404), a
    │   ├── SessionBusy                 call while another runs (409), a session ended
    │   ├── SessionEnded                or at a limit, a context past the engine's
    │   ├── SessionLimit                window (400), the engines failing the call
    │   ├── ContextTooLong              (503; the session ends with status error),
    │   ├── GatewayEngineError          treadle failing the call (500, a bug; the
    │   ├── GatewayInternalError        session ends, stage runtime); and of a served
    │   ├── UnknownTool                 tool: no such tool
    │   └── NoReplyYet                  (404), a tool call before the first reply (409)
    ├── ServiceBusy                     treadle.service.errors: too many trajectories
    │                                   queued to take the job now (the API's 503)
    ├── Forbidden                       treadle.service.errors: a key whose scope does
    │                                   not cover the request (the API's 403)
    ├── PolicyMismatch                  treadle.service.versions: the engines serve
    │                                   weights a job is not for (past its version, or
    │                                   another trainer run's; the API's 409)
    ├── SandboxError                    anything from treadle.sandbox
    │   ├── SandboxStartError           a sandbox could not be created (may be retried)
    │   │   └── SandboxUnavailable      the backend cannot run on this host at all
    │   │                               (bwrap missing, user namespaces disabled);
    │   │                               retrying will not help
    │   │       └── SandboxImageError   an environment image missing, corrupt or
    │   │                               unusable (treadle.sandbox.images)
    │   ├── SandboxClosed               the sandbox or pool was closed before the call
    │   │   └── UnknownSandbox          treadle.sandbox.server: no sandbox by that id
    │   ├── SandboxSupervisorError      an exec's supervisor (bwrap) died or failed: killed
    │   │                               from outside, or its setup failed; the command's
    │   │                               result is unknown
    │   ├── SandboxUnsupported          a call this backend cannot serve (a Python
    │   │                               session without bwrap's resident executor)
    │   ├── RemoteSandboxError          treadle.sandbox.remote: a sandbox server not
    │   │                               reached, failing, or answering off-contract
    │   ├── SandboxPathError            a path names something outside the work dir,
    │   │                               or is malformed (also a ValueError)
    │   └── SandboxFileError            a file in the work dir cannot be read or written
    │       └── SandboxFileTooLarge     get_file found more than max_bytes
    ├── EnvError                        anything from treadle.envs (its classes live in
    │   ├── TaskFormatError             treadle.envs.errors): a malformed task record,
    │   ├── EnvConfigError              an environment set up wrongly by its caller,
    │   │   └── SweImageBuildError      treadle.envs.suites.swe_builtin: a built-in
    │   │                               SWE image that could not be built
    │   ├── ResourcesServerError        an external resources server that failed;
    │   │   └── MaskedSampleError       treadle.envs.adapters.nemo_gym: its verify
    │   │                               masked the sample (a judge failure: excluded)
    │   ├── ToolInputError              treadle.envs.tools.base: a tool call the model
    │   │                               got wrong, raised inside a tool and turned into
    │   │                               an error observation (never escapes Tool.call)
    │   └── PatchError                  treadle.envs.tools.patch: a diff that is
    │                                   malformed or does not apply (also a ValueError)
    ├── EngineError                     anything from treadle.engines (classes in
    │   ├── EngineUnavailable           treadle.engines.errors): engine down or
    │   │   ├── EngineStartError        unreachable (an engine that did not start, no
    │   │   ├── NoEngineAvailable       engine left at all, one that does not serve the
    │   │   ├── EngineModelMissing      model asked for; WireError: treadle.engines._wire,
    │   │   └── WireError               the connection itself), a request past its
    │   ├── EngineTimeout               deadline (WeightUpdateTimeout: a weight
    │   │   └── WeightUpdateTimeout     update past its own; the old weights serve),
    │   │                               a malformed reply (names the
    │   ├── EngineProtocolError         field), a request the engine rejected (also
    │   └── EngineRequestError          a ValueError)
    ├── JudgeError                      treadle.rewards.errors: a judgement that did
    │   ├── JudgeCallError              not come out: the judge's call failed, or its
    │   └── VerdictError                reply holds no verdict on the scale (retried,
    │                                   then recorded as the dimension's reason)
    ├── StoreError                      anything from treadle.store (classes in
    │   ├── RecordError                 treadle.store.errors): a malformed trajectory
    │   │                               record (names the field; also a ValueError),
    │   ├── NotFound                    a job or trajectory the store does not hold
    │   │                               (also a LookupError), a request contradicting
    │   ├── StoreConflict               what is stored (a job id taken, a result for
    │   │                               the wrong group), a database file from a newer
    │   ├── SchemaError                 treadle or not a treadle store at all, the
    │   └── StoreProcessLost            store's own process gone during a batch
    └── ClientError                     anything from treadle.client (classes in
        ├── ConversionError             treadle.client.errors): trajectories a trainer
        │                               format cannot express (unscored, several
        │                               segments where one row is allowed, a broken
        │                               group; also a ValueError), delivered
        ├── GroupError                  trajectories that do not fit the declared
        │                               groups (also a ValueError), an error answer
        ├── ServiceError                of the rollout service (its HTTP status and
        │                               detail), a service not reached or a stream
        ├── ServiceUnavailable          not resumed within the retries, a reply
        └── ServiceProtocolError        breaking the API's contract (not JSON, a bad
                                        record, a gap in sequence numbers)

Foreign errors are translated where they enter: httpx's by one module per HTTP
client (`treadle.engines._http`; `treadle.client.stream`, shared by the sync and
the async client; `treadle.sandbox.remote`), never left to escape.

What a sandboxed command does is never an exception: a crash, a timeout, a
memory or CPU kill or a truncated output comes back as an `ExecResult`. The tree is
for the infrastructure failing, which a trainer must tell apart from the agent
failing (an infrastructure failure is excluded from training, an agent mistake is
not).
"""

from __future__ import annotations


class TreadleError(Exception):
    """Root of every exception treadle raises on purpose."""


class InputError(TreadleError, ValueError):
    """Bad input from a caller; the message names the field and what is wrong."""


class UsageError(InputError):
    """A command line the CLI refuses: printed as one line, exit code 2."""


class ServiceBusy(TreadleError):
    """The service holds `max_queued` trajectories not yet started: a job that would
    pass it is refused whole (nothing stored); the API answers 503 with Retry-After."""


class SandboxError(TreadleError):
    """Root of the sandbox layer's exceptions."""


class SandboxStartError(SandboxError):
    """A sandbox could not be created; a later attempt may succeed."""


class SandboxUnavailable(SandboxStartError):
    """The backend cannot run on this host; the message says what to install or enable."""


class SandboxImageError(SandboxUnavailable):
    """An environment image cannot be used: missing, corrupt, of a format treadle does
    not read, or lacking what a sandbox needs; the message names the image and why."""


class SandboxClosed(SandboxError):
    """The sandbox (or the pool it came from) is closed."""


class SandboxSupervisorError(SandboxError):
    """The process supervising an exec died or failed before it could report the command.

    Killed from outside (a signal treadle did not send), or its setup failed before
    the command started. What the command did is unknown: not the agent's doing.
    """


class SandboxUnsupported(SandboxError):
    """The sandbox cannot serve this kind of call at all (`Sandbox.run_cell` where
    `keeps_python_session` is False); the message names what would."""


class SandboxPathError(SandboxError, ValueError):
    """A path is malformed or resolves outside the sandbox's work dir."""


class SandboxFileError(SandboxError):
    """A work-dir file is missing, not a regular file, or cannot be written."""


class SandboxFileTooLarge(SandboxFileError):
    """A file is larger than the caller's `max_bytes`."""

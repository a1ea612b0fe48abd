"""Who a request speaks for: its bearer key, resolved to a principal.

Three kinds of key, each its own principal (docs/security.md has the whole model):

- the **admin**'s: the service token (`treadle serve --token`); every route;
- a **trainer**'s, bound to one trainer run: from `treadle serve --keys FILE`
  (lines ``RUN sha256:HEX`` that `treadle keys new` writes) or `POST /v1/keys`
  (the admin's; kept in the store, so a restart keeps them). It sees and changes
  its own run's jobs, the sessions it made, the weights it pushes as its run;
- a **session**'s, minted with each gateway session (`POST /v1/sessions`, or a
  harness job's run): only that session's OpenAI routes, and only while it is open.

Keys are `secrets.token_urlsafe(32)` (256 random bits) behind a prefix that says
their kind (``trk_``, ``sek_``: a leaked one is recognisable). Only their SHA-256
digests are kept, in memory and in the store; a presented key is hashed and looked
up by its digest, the admin token compared with `hmac.compare_digest`. Timing
tells nothing usable: a lookup's time depends on the digest, which an attacker
cannot steer towards a key. Keys are never logged (nothing here logs them; the
service has no access log).

Without a token the service has no auth: every request is the admin's (loopback
use only), and keys are not needed.

A session key dies with its session: the gateway revokes it when the session ends,
and `KeyRing.resolve` also refuses a key whose session is no longer open (however
it ended), so no path of a session's end can leave its key working. Keys of ended
sessions are swept as new ones are minted: memory stays proportional to the open
sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from treadle.gateway.errors import UnknownSession
from treadle.service.errors import Forbidden
from treadle.store.aio import AsyncStore
from treadle.store.errors import StoreConflict
from treadle.store.jobs import TrainerKey

TRAINER_PREFIX = "trk_"  # trainer keys
SESSION_PREFIX = "sek_"  # session keys
TRAINER_RUN = re.compile(r"^[A-Za-z0-9._:/-]{1,128}$")  # as JobRequest.trainer_run
_FILE_LINE = re.compile(r"^(\S+)\s+sha256:([0-9a-f]{64})$")


@dataclass(frozen=True, slots=True)
class Admin:
    """The service token's holder: every route."""


@dataclass(frozen=True, slots=True)
class Trainer:
    """A trainer key's holder: the jobs, sessions and weights of trainer run `run`."""

    run: str


@dataclass(frozen=True, slots=True)
class SessionHolder:
    """A session key's holder: that open session's OpenAI routes, nothing else."""

    session_id: str


Caller = Admin | Trainer  # who may own jobs and sessions
Principal = Admin | Trainer | SessionHolder


def owner_of(caller: Caller) -> str | None:
    """What a job or session made by `caller` is owned by: its trainer run, or None
    (the admin's)."""
    match caller:
        case Trainer(run=run):
            return run
        case Admin():
            return None


def sees(caller: Caller, owner: str | None) -> bool:
    """Whether `caller` may see (and change) what `owner` owns: the admin everything,
    a trainer its own run's."""
    match caller:
        case Admin():
            return True
        case Trainer(run=run):
            return owner == run


def run_named(caller: Caller, named: str | None) -> str | None:
    """The trainer run a job or weight update of `caller` is for: the admin's as
    named; a trainer's always its own (none named: its own), another's a Forbidden."""
    match caller:
        case Admin():
            return named
        case Trainer(run=run):
            if named not in (None, run):
                raise Forbidden(f"trainer_run: this key is trainer run {run!r}'s; it may "
                                "name no other run")
            return run


def door_paths(session_id: str) -> frozenset[str]:
    """The fixed paths a session's key opens: its OpenAI routes and its tools' list
    (`opens_door` adds each tool's path)."""
    base = f"/v1/sessions/{session_id}"
    return frozenset({f"{base}/openai/v1/chat/completions", f"{base}/openai/v1/models",
                      f"{base}/tools"})


def opens_door(session_id: str, path: str) -> bool:
    """Whether a key of `session_id` opens `path`: `door_paths`, or one of its tools
    (``/v1/sessions/{id}/tools/{name}``, a name without a slash)."""
    tools = f"/v1/sessions/{session_id}/tools/"
    return path in door_paths(session_id) or (
        path.startswith(tools) and len(path) > len(tools) and "/" not in path[len(tools):])


def digest(key: str | bytes) -> bytes:
    """SHA-256 of a key: all that is kept of it."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def new_key(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


# -- trainer keys ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrainerKeyView:
    """A trainer key as the admin sees it listed: never the key."""

    key_id: str  # its public name (revocation names it)
    trainer_run: str
    source: str  # "api" (POST /v1/keys, kept in the store) | "file" (--keys)
    created_at: float | None  # None for a keys file's


@dataclass(frozen=True, slots=True)
class FileKey:
    """One line of a keys file: a trainer run and its key's digest."""

    trainer_run: str
    digest: bytes


def file_line(trainer_run: str, key: str) -> str:
    """The keys-file line of `key` for `trainer_run` (what `treadle keys new` writes)."""
    check_run(trainer_run)
    return f"{trainer_run} sha256:{digest(key).hex()}"


def read_keys_file(path: str | Path) -> list[FileKey]:
    """A keys file: one ``TRAINER_RUN sha256:HEX`` a line (blank lines and lines
    starting with ``#`` skipped); ValueError naming the file and line of a bad one."""
    out = []
    text = Path(path).read_text(encoding="utf-8")
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _FILE_LINE.match(line)
        if match is None or TRAINER_RUN.match(match.group(1)) is None:
            raise ValueError(f"{path}:{number}: not 'TRAINER_RUN sha256:<64 hex digits>' "
                             "(treadle keys new writes such lines)")
        out.append(FileKey(match.group(1), bytes.fromhex(match.group(2))))
    if len({k.digest for k in out}) != len(out):
        raise ValueError(f"{path}: a key is listed twice")
    return out


def check_run(trainer_run: str) -> None:
    if TRAINER_RUN.match(trainer_run) is None:
        raise ValueError(f"trainer run {trainer_run[:40]!r}: 1 to 128 of A-Z a-z 0-9 . _ : / -")


# -- session keys ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionGrant:
    """What a session's key grants, and who owns the session."""

    session_id: str
    owner: str | None  # the trainer run whose session it is (None: the admin's)
    # A harness job's session: treadle judges and ends it, nobody through the API.
    treadle_ends: bool = False


class SessionKeys:
    """The keys of open sessions: minted with a session, revoked with its end."""

    def __init__(self) -> None:
        self._grants: dict[bytes, SessionGrant] = {}  # key digest -> its grant
        self._digests: dict[str, bytes] = {}  # session id -> its key's digest
        self._sweep_at = 64  # grants held before the next sweep of ended sessions

    def __len__(self) -> int:
        return len(self._grants)

    def grant(self, session_id: str, owner: str | None, *, treadle_ends: bool = False,
              live: Callable[[str], bool] | None = None) -> str:
        """A new key for `session_id` (replacing any it had); with `live`, keys of
        sessions no longer open are dropped first once enough have gathered."""
        if live is not None and len(self._grants) >= self._sweep_at:
            for ended in [s for s in self._digests if not live(s)]:
                self.revoke(ended)
            self._sweep_at = 2 * len(self._grants) + 64
        self.revoke(session_id)
        key = new_key(SESSION_PREFIX)
        self._grants[digest(key)] = SessionGrant(session_id, owner, treadle_ends)
        self._digests[session_id] = digest(key)
        return key

    def restore(self, session_id: str, key_digest: bytes, owner: str | None) -> None:
        """The key a session had before a restart opens it again (its digest was kept
        in the session's journal)."""
        self.revoke(session_id)
        self._grants[key_digest] = SessionGrant(session_id, owner)
        self._digests[session_id] = key_digest

    def revoke(self, session_id: str) -> None:
        """The session's key opens nothing from now on (no key: nothing to do)."""
        found = self._digests.pop(session_id, None)
        if found is not None:
            del self._grants[found]

    def of(self, session_id: str) -> SessionGrant | None:
        """The grant of a session that has a key."""
        found = self._digests.get(session_id)
        return None if found is None else self._grants[found]

    def lookup(self, key_digest: bytes) -> SessionGrant | None:
        return self._grants.get(key_digest)


# -- the ring ----------------------------------------------------------------------------


class KeyRing:
    """Every key of one service, resolved to principals (module docstring).

    `live(session_id)` says whether a session is still open: a key of one that is not
    resolves to nothing. Trainer keys from the store are loaded by `load` (at start);
    from then on this ring is their only writer."""

    def __init__(self, token: str | None, store: AsyncStore, sessions: SessionKeys,
                 live: Callable[[str], bool], file_keys: Sequence[FileKey] = ()) -> None:
        if file_keys and token is None:
            raise ValueError("trainer keys need a service token: without one every request "
                             "is the admin's")
        self.auth = token is not None  # False: no auth, every request is the admin's
        self._token = b"" if token is None else digest(token)
        self._store = store
        self.sessions = sessions
        self._live = live
        self._file = {k.digest: k.trainer_run for k in file_keys}
        self._stored: dict[bytes, TrainerKeyView] = {}  # the API's, by digest

    async def load(self) -> None:
        """The trainer keys kept in the store (made through the API before)."""
        self._stored = {bytes.fromhex(k.digest): _api_view(k)
                        for k in await self._store.trainer_keys()}

    def principal(self, authorization: bytes | None) -> Principal | None:
        """The principal of an ``Authorization: Bearer KEY`` header value; None for a
        missing, malformed, unknown, revoked or expired key (a 401)."""
        if not self.auth:
            return Admin()
        scheme, _, given = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return self.resolve(given.strip())

    def resolve(self, key: bytes) -> Principal | None:
        """The principal a key speaks for (see `principal`)."""
        if not self.auth:
            return Admin()
        if not key:
            return None
        found = digest(key)
        if hmac.compare_digest(found, self._token):
            return Admin()
        run = self._file.get(found)
        if run is not None:
            return Trainer(run)
        stored = self._stored.get(found)
        if stored is not None:
            return Trainer(stored.trainer_run)
        grant = self.sessions.lookup(found)
        if grant is not None and self._live(grant.session_id):
            return SessionHolder(grant.session_id)
        if grant is not None:  # its session ended some way that did not revoke it
            self.sessions.revoke(grant.session_id)
        return None

    def owned_session(self, caller: Caller, session_id: str) -> SessionGrant | None:
        """The grant of a session `caller` sees (None: one without a key, which only
        the admin sees); UnknownSession (404) for one it does not, as for no session."""
        grant = self.sessions.of(session_id)
        if not sees(caller, None if grant is None else grant.owner):
            raise UnknownSession(f"no open session {session_id!r}")
        return grant

    def grant_session(self, session_id: str, owner: str | None) -> str:
        """A key for a session made through the API by `owner`'s key."""
        return self.sessions.grant(session_id, owner, live=self._live)

    # -- trainer keys ------------------------------------------------------------------

    async def add_trainer_key(self, trainer_run: str) -> tuple[TrainerKeyView, str]:
        """A new trainer key for `trainer_run`, kept (as its digest) in the store:
        (its view, the key). The key is in this answer only."""
        check_run(trainer_run)
        key = new_key(TRAINER_PREFIX)
        kept = await self._store.add_trainer_key("k" + secrets.token_hex(8),
                                                 digest(key).hex(), trainer_run)
        self._stored[digest(key)] = view = _api_view(kept)
        return view, key

    def trainer_keys(self) -> list[TrainerKeyView]:
        """Every trainer key: the keys file's, then those made through the API."""
        return [*(TrainerKeyView(file_key_id(d), run, "file", None)
                  for d, run in self._file.items()),
                *sorted(self._stored.values(), key=lambda k: k.created_at or 0.0)]

    async def revoke_trainer_key(self, key_id: str) -> None:
        """Revoke a key made through the API, at once; NotFound for no such key,
        StoreConflict for a keys file's (the file is what keeps it: edit it and
        restart)."""
        if any(file_key_id(d) == key_id for d in self._file):
            raise StoreConflict(f"key {key_id!r} comes from the keys file: remove its "
                                "line and restart the service")
        found = next((d for d, k in self._stored.items() if k.key_id == key_id), None)
        if found is not None:
            del self._stored[found]  # refused from now on, before the store's write
        # NotFound for none; a write that failed (or whose request was cancelled) is
        # made again by repeating the revocation.
        await self._store.delete_trainer_key(key_id)


def _api_view(key: TrainerKey) -> TrainerKeyView:
    return TrainerKeyView(key.key_id, key.trainer_run, "api", key.created_at)


def file_key_id(key_digest: bytes) -> str:
    """A keys-file key's public name: the start of its digest."""
    return "f" + key_digest.hex()[:16]


__all__ = ["Admin", "Caller", "FileKey", "KeyRing", "Principal", "SessionGrant",
           "SessionHolder", "SessionKeys", "Trainer", "TrainerKeyView", "digest",
           "door_paths", "file_line", "opens_door", "owner_of", "read_keys_file", "run_named",
           "sees"]

"""The `remote` backend: sandboxes hosted by sandbox servers, reached over HTTP.

    backend = RemoteBackend(["http://10.0.0.5:8790", "http://10.0.0.6:8790"], token)
    async with await backend.start(Limits(memory_mb=512)) as sb:
        result = await sb.exec(["python3", "-c", "print(1)"], timeout_s=10)

A server (`treadle sandbox-server`, `.server`) hosts sandboxes of a local backend
(bwrap in production); this is the client (the wire models are `.wire`). Needs the
`server` extra.

Placement: a start goes to the server where this backend has the fewest sandboxes
open (ties rotate); an unreachable one is skipped for a back-off period and must
pass `/healthz` before reuse; one that refuses a create (full, backend failed) is
skipped for that start only. A sandbox stays on its server.

The servers can change while sandboxes run (a fleet that follows demand,
`runtime.ray_sandboxes`): `add_server` takes a new one into placement at once;
`retire_server` takes one out of it (its open sandboxes stay until they close) and
`remove_server` forgets a retired one once nothing is open there. A copy of the
backend in another process follows the same servers with `follow(accepting())`.

The wire format (JSON over HTTP, bearer token on all but `/healthz`; endpoints in
docs/sandbox.md) is `treadle.sandbox.wire`'s models. An `ErrorReply` is raised as the exception it
names if in `WIRE_ERRORS`, else as `RemoteSandboxError`. Contracts beyond `base`:

- Transport failures, server errors and malformed answers raise `RemoteSandboxError`
  (a `SandboxError`: the infrastructure failed, not the agent).
- A start cancelled midway deletes what it made (best effort; else the TTL).
- A started sandbox is a `RemoteSandbox` (`.remote_sandbox`: its exec, files,
  keepalive and close, and their contracts).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import secrets
import ssl
import time
from collections.abc import Sequence

import httpx

from treadle.errors import SandboxImageError, SandboxStartError, SandboxUnavailable
from treadle.sandbox.base import Limits, Sandbox, SandboxBackend
from treadle.sandbox.remote_sandbox import (
    JSON_HEADERS,
    RemoteSandbox,
    RemoteSandboxError,
    ServerSlot,
    abandon,
    error_reply,
    parse_reply,
    shielded,
)
from treadle.sandbox.wire import Created, CreateRequest, Health, LimitsModel

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 5.0
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # after the n-th consecutive failure of a server


def _url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"server URLs must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client: each new one loads the CA store (~35 ms of CPU)."""
    return ssl.create_default_context()


class _Refused(Exception):
    """One server could not create a sandbox; the backend tries the next."""

    def __init__(self, cause: Exception, *, unreachable: bool = False,
                 permanent: bool = False) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.unreachable = unreachable  # transport failure: back off, probe before reuse
        self.permanent = permanent  # retrying cannot help (wrong token, no backend there)


class RemoteBackend(SandboxBackend):
    """Makes `RemoteSandbox`es on a pool of sandbox servers; see the module docstring.

    servers: base URLs ("http://host:port"; https behind a TLS proxy); none is allowed
    when a fleet adds them (`add_server`): a start then fails as no server takes it.
    token: the servers' bearer token (one token for the pool).
    connect_timeout_s: per connection attempt; an unreachable server costs this much.
    """

    name = "remote"

    def __init__(self, servers: Sequence[str], token: str, *,
                 connect_timeout_s: float = 5.0) -> None:
        urls = [_url(s) for s in ([servers] if isinstance(servers, str) else servers)]
        if len(set(urls)) != len(urls) or not token:
            raise ValueError("RemoteBackend needs distinct server URLs and the servers' token")
        self._servers = [ServerSlot(url) for url in urls]
        self._token = token
        self._connect_timeout_s = connect_timeout_s
        self._turn = 0  # rotates the order among equally loaded servers
        self.image: str | None = None  # asked of the servers at each start (with_image)

    def with_image(self, image: str | None) -> RemoteBackend:
        """A backend on the same servers (the same pool: their load, a fleet's changes)
        whose sandboxes run on `image`, a ref as the servers' hosts name it under their
        `--images` root; a server that does not run it refuses (SandboxImageError)."""
        other = copy.copy(self)  # shallow: the server list is shared
        other.image = image
        return other

    def outstanding(self) -> dict[str, int]:
        """Sandboxes this backend has open (or is creating) per server URL, retiring
        servers included."""
        return {s.url: s.outstanding for s in self._servers}

    def add_server(self, url: str) -> None:
        """Place sandboxes on the server at `url` from the next start on (ValueError if
        it is there already, or not an http(s) URL)."""
        url = _url(url)
        if any(s.url == url for s in self._servers):
            raise ValueError(f"sandbox server {url} is already in the pool")
        self._servers.append(ServerSlot(url))

    def retire_server(self, url: str) -> int:
        """No new sandbox on the server at `url`; the ones open there stay until they
        close. Returns how many are open (KeyError if it is not in the pool)."""
        server = self._server(url)
        server.retiring = True
        return server.outstanding

    async def drain_server(self, url: str) -> int:
        """Have the server at `url` refuse new sandboxes from every client (`POST
        /v1/drain`; the ones open there carry on) and return how many are live there
        as of it: from then on that count only falls. RemoteSandboxError when it cannot
        be reached or answers badly (an error it names, as that exception)."""
        url = _url(url)
        async with httpx.AsyncClient(
                base_url=url, headers={"authorization": f"Bearer {self._token}"},
                trust_env=False, verify=_tls(), timeout=_PROBE_TIMEOUT_S) as client:
            try:
                response = await client.post("/v1/drain")
            except httpx.HTTPError as e:
                raise RemoteSandboxError(f"{url}: {e!r}") from e
        if response.status_code >= 300:
            raise error_reply(response, url)
        return parse_reply(Health, response, url).live

    def remove_server(self, url: str) -> None:
        """Forget a retired server with nothing open (ValueError otherwise)."""
        server = self._server(url)
        if not server.retiring or server.outstanding:
            raise ValueError(f"sandbox server {url}: retire it and let its "
                             f"{server.outstanding} sandbox(es) close before removing it")
        self._servers.remove(server)

    def accepting(self) -> tuple[str, ...]:
        """The servers new sandboxes may start on (not retiring), in order."""
        return tuple(s.url for s in self._servers if not s.retiring)

    def follow(self, accepting: Sequence[str]) -> None:
        """Make `accepting` the servers new sandboxes start on, as another backend's
        `accepting()` (a fleet's, followed by a copy of this backend elsewhere): add
        the new ones, retire the others, forget the retired ones with nothing open."""
        urls = [_url(u) for u in accepting]
        known = {s.url: s for s in self._servers}
        for url in urls:
            if url in known:
                known[url].retiring = False  # (a URL a new server took again)
            else:
                self.add_server(url)
        for server in list(self._servers):
            if server.url not in urls:
                server.retiring = True
                if not server.outstanding:
                    self._servers.remove(server)

    def _server(self, url: str) -> ServerSlot:
        url = url.rstrip("/")
        for server in self._servers:
            if server.url == url:
                return server
        raise KeyError(f"no sandbox server {url} in the pool")

    async def health(self) -> dict[str, bool]:
        """Probe every server's /healthz now; a failing one is skipped by starts until it
        passes, a draining one retired (it takes no new sandboxes again)."""
        results = await asyncio.gather(*(self._probe(s) for s in self._servers))
        return {s.url: ok for s, ok in zip(self._servers, results, strict=True)}

    async def start(self, limits: Limits) -> Sandbox:
        """A sandbox on the least loaded healthy server.

        Raises SandboxUnavailable when every server refused for a reason retrying
        cannot fix (wrong token, backend unavailable; SandboxImageError when each
        refused the image), else SandboxStartError naming each server's failure.
        """
        failures: list[str] = []
        permanent = images = True  # every refusal permanent; every one the image's
        for server in self._placement_order():
            if server.failures and not await self._probe(server):
                failures.append(f"{server.url}: failed its health check")
                permanent = images = False
                continue
            server.outstanding += 1  # before awaiting: concurrent starts spread out
            try:
                return await self._create_on(server, limits)
            except _Refused as e:
                server.outstanding -= 1
                failures.append(str(e))
                permanent = permanent and e.permanent
                images = images and isinstance(e.cause, SandboxImageError)
                if e.unreachable:
                    self._mark_down(server)
            except BaseException:
                server.outstanding -= 1
                raise
        if not failures:
            raise SandboxStartError("no sandbox server takes new sandboxes (none in the "
                                    "pool, or all retiring)")
        cls = (SandboxImageError if permanent and images else
               SandboxUnavailable if permanent else SandboxStartError)
        raise cls("no sandbox server could start a sandbox: " + "; ".join(failures))

    def _placement_order(self) -> list[ServerSlot]:
        """Healthy servers by load (ties rotate), then suspects due for a probe.

        When every server is suspect and backing off, all are probed anyway: a
        fleet-wide blip must not fail starts for the whole back-off period.
        """
        now = time.monotonic()
        accepting = [s for s in self._servers if not s.retiring]
        if not accepting:
            return []
        self._turn = (self._turn + 1) % len(accepting)
        rotated = accepting[self._turn:] + accepting[:self._turn]
        healthy = sorted((s for s in rotated if not s.failures), key=lambda s: s.outstanding)
        due = sorted((s for s in rotated if s.failures and s.retry_at <= now),
                     key=lambda s: s.retry_at)
        return healthy + due or rotated

    def _mark_down(self, server: ServerSlot) -> None:
        server.failures += 1
        delay = _BACKOFF_S[min(server.failures, len(_BACKOFF_S)) - 1]
        server.retry_at = time.monotonic() + delay
        log.warning("sandbox server %s unreachable; skipping it for %.0fs", server.url, delay)

    async def _probe(self, server: ServerSlot) -> bool:
        try:
            async with httpx.AsyncClient(base_url=server.url, trust_env=False,
                                         verify=_tls(), timeout=_PROBE_TIMEOUT_S) as client:
                response = await client.get("/healthz")
            status = (parse_reply(Health, response, server.url).status
                      if response.status_code == 200 else "")
        except (httpx.HTTPError, RemoteSandboxError):
            status = ""
        if status == "draining":  # up, and for good taking no new sandboxes: retired here
            server.retiring = True
            return False
        ok = status == "ok"
        if ok:
            server.failures = 0
        else:
            self._mark_down(server)
        return ok

    async def _create_on(self, server: ServerSlot, limits: Limits) -> RemoteSandbox:
        # The sandbox's own connections. trust_env=False: no proxy from the environment
        # may receive the token.
        client = httpx.AsyncClient(
            base_url=server.url, headers={"authorization": f"Bearer {self._token}"},
            trust_env=False, verify=_tls(),
            timeout=httpx.Timeout(60.0, connect=self._connect_timeout_s),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=4))
        body = CreateRequest(id=secrets.token_urlsafe(18), limits=LimitsModel.from_limits(limits),
                             image=self.image)
        try:
            response = await client.post("/v1/sandboxes", content=body.model_dump_json(),
                                         headers=JSON_HEADERS)
            if response.status_code != 201:
                error = error_reply(response, server.url)
                raise _Refused(error, permanent=response.status_code == 401
                               or isinstance(error, SandboxUnavailable))
            created = parse_reply(Created, response, server.url)
        except BaseException as e:
            # The server may have made it (a timeout, a cancelled start): undo, shielded.
            made = not isinstance(e, _Refused | httpx.ConnectError | httpx.ConnectTimeout)
            await shielded(abandon(client, body.id, delete=made))
            if isinstance(e, httpx.HTTPError | RemoteSandboxError):
                raise _Refused(RemoteSandboxError(f"{server.url}: {e!r}"),
                               unreachable=isinstance(e, httpx.TransportError)) from e
            raise
        return RemoteSandbox(server=server, client=client, created=created, limits=limits)


__all__ = ["RemoteBackend", "RemoteSandbox", "RemoteSandboxError"]

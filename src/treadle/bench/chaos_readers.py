"""The clients of a chaos run: what reads the service while faults land.

- `Follower`: the HTTP client's `trajectories()` through the faulty network, with
  patient retries and a short `stream_idle_s` (half-open connections are noticed):
  what it was handed, in order.
- `RawReader`: a plain NDJSON reader, as a trainer without treadle's client would
  write one: reconnects from the last complete line's seq; keeps every line's bytes,
  so that a seq read twice can be compared.
- `HangUps`: clients that follow a stream and hang up after a fraction of a second,
  again and again (a trainer's reconnects, a proxy, a load balancer).

Each runs in a thread until its job has delivered everything it planned, or until
`stop` is set; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

from treadle.client import RetryPolicy, RolloutClient
from treadle.client.errors import ClientError

# The default patience (five minutes), retried more often than the default's 5 s so
# that a reader is back soon after the service.
PATIENT = RetryPolicy(attempts=400, backoff_s=0.05, max_backoff_s=0.5)
IDLE_S = 3.0  # silence before a reader takes its connection for dead


@dataclass(slots=True)
class Follower:
    """`RolloutClient.trajectories` of one job; see the module docstring."""

    url: str
    token: str
    job_id: str
    seqs: list[int] = field(default_factory=list)  # in the order handed out
    ids: list[str] = field(default_factory=list)  # trajectory ids, same order
    error: str | None = None  # why it gave up, if it did

    def run(self, stop: threading.Event) -> None:
        try:
            with RolloutClient(self.url, token=self.token, retry=PATIENT,
                               stream_idle_s=IDLE_S) as client:
                for d in client.trajectories(self.job_id):
                    self.seqs.append(d.seq)
                    self.ids.append(d.trajectory.trajectory_id)
                    if stop.is_set():
                        return
        except ClientError as e:
            self.error = f"{type(e).__name__}: {e}"


@dataclass(slots=True)
class RawReader:
    """A plain NDJSON reader of one job; see the module docstring."""

    url: str
    token: str
    job_id: str
    planned: int
    lines: dict[int, bytes] = field(default_factory=dict)  # seq -> the line's bytes
    duplicates: int = 0  # lines of a seq already read, across reconnections
    reconnects: int = 0

    def run(self, stop: threading.Event) -> None:
        headers = {"authorization": f"Bearer {self.token}"}
        timeout = httpx.Timeout(10.0, read=IDLE_S)
        while len(self.lines) < self.planned and not stop.is_set():
            after = max(self.lines, default=0)
            try:
                with httpx.stream("GET", f"{self.url}/v1/jobs/{self.job_id}/trajectories",
                                  params={"after": after, "follow": "true"},
                                  headers=headers, timeout=timeout) as r:
                    if r.status_code == 200:
                        self._read(r)
            except httpx.HTTPError:
                pass
            self.reconnects += 1
            stop.wait(0.05)

    def _read(self, r: httpx.Response) -> None:
        partial = b""
        for chunk in r.iter_bytes():
            *complete, partial = (partial + chunk).split(b"\n")
            for line in complete:
                if not line.strip():
                    continue  # a heartbeat
                seq = int(json.loads(line)["seq"])
                if seq in self.lines:
                    self.duplicates += 1
                self.lines[seq] = line


@dataclass(slots=True)
class HangUps:
    """Followers that hang up; see the module docstring."""

    url: str
    token: str
    job_ids: list[str]
    rng: random.Random
    count: int = 0  # streams opened and dropped

    def run(self, stop: threading.Event) -> None:
        headers = {"authorization": f"Bearer {self.token}"}
        while not stop.is_set():
            job = self.rng.choice(self.job_ids)
            hold_s = self.rng.uniform(0.05, 1.0)
            with contextlib.suppress(httpx.HTTPError), \
                    httpx.stream("GET", f"{self.url}/v1/jobs/{job}/trajectories",
                                 params={"follow": "true"}, headers=headers,
                                 timeout=httpx.Timeout(5.0, read=hold_s)) as r:
                deadline = time.monotonic() + hold_s
                for _ in r.iter_bytes():
                    if time.monotonic() > deadline:
                        break
            self.count += 1


__all__ = ["IDLE_S", "PATIENT", "Follower", "HangUps", "RawReader"]
